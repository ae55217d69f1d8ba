// resnet.cc: a residual network with BatchNorm (models.h) classifying Fashion-MNIST, its three
// residual connections crossing stages.
#include "tasks/builtin.h"

#include "gpipe/models.h"
#include "gpipe/workloads.h"

namespace gpipe::tasks {

Task resnet() {
  Task t;
  t.name = "resnet";
  t.title = "ResNet";
  t.summary = "a residual network with BatchNorm on Fashion-MNIST, 30 layers, cut by measured time";
  t.layers = kFashionResnetLayers;
  t.scoring = accuracy_scoring();
  t.loss = cross_entropy_loss;
  t.loss_name = "cross_entropy";
  t.data_dir = kFashionMnistDir;
  t.defaults.epochs = 14;
  t.defaults.lr_schedule = LrSchedule::kCosine;
  t.defaults.flip = true;
  t.defaults.cut_by_time = true;  // its blocks differ in time per layer by 10x
  t.model = [](const TaskOptions& o) {
    return seeded_model("ResNet", kFashionResnetLayers, o.seed(), fashion_resnet);
  };
  t.data = fashion_data;
  t.batch = workload_batch("resnet");
  return t;
}

}  // namespace gpipe::tasks
