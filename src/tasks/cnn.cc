// cnn.cc: gpipe train's default task: a small CNN (models.h) classifying Fashion-MNIST.
#include "tasks/builtin.h"

#include "gpipe/models.h"

namespace gpipe::tasks {

Task cnn() {
  Task t;
  t.name = "cnn";
  t.title = "CNN";
  t.summary = "a small CNN on Fashion-MNIST (the default): 2 convolution blocks and a classifier, 11 layers";
  t.layers = kFashionCnnLayers;
  t.scoring = accuracy_scoring();
  t.loss = cross_entropy_loss;
  t.loss_name = "cross_entropy";
  t.data_dir = kFashionMnistDir;
  t.model = [](const TaskOptions& o) { return seeded_model("CNN", kFashionCnnLayers, o.seed(), fashion_cnn); };
  t.data = fashion_data;
  t.batch = [](const TaskOptions& o) { return random_images(128, o.seed()); };
  // The cuts measured best on 2 devices of one core each (docs/benchmarks.md): {3, 8} is the
  // contiguous min-max cut, but its stages differ by 1.5x in time; interleaving the model as 4
  // stages, {conv1 block, conv2, relu+pool, classifier} on devices 0, 1, 0, 1, evens them out.
  t.cut = [](int devices, ScheduleKind schedule, int V) {
    if (devices == 2 && V == 1) return CutRequest::given({3, 8});
    if (devices == 2 && V == 2 && schedule == ScheduleKind::kInterleaved) return CutRequest::given({3, 1, 2, 5});
    return CutRequest::even();  // the V's take the even cut
  };
  // On 2 devices, interleaved with the cut above (measured fastest: bench/train_vs_pytorch.sh).
  t.schedule = [](int devices, int micro_batches) {
    return devices == 2 && micro_batches % 2 == 0 ? std::pair{ScheduleKind::kInterleaved, 2}
                                                  : std::pair{ScheduleKind::kGPipe, 1};
  };
  return t;
}

}  // namespace gpipe::tasks
