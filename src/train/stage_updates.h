// stage_updates.h: a training step's optimizer update applied stage by stage on the devices during
// the next step (Trainer::fit), instead of on the calling thread while every device waits.
//
//   step t:   devices run the program ........ | Trainer: hold(lr)  (the gradients taken, nothing applied)
//   step t+1: device d, before stage s's first action: apply(s), in time it would wait for its input
//             ... | Trainer: apply_remaining(), hold(lr) again; give_back() before a save, an
//             evaluation, or fit's return
//
// Each stage held here gets an optimizer of its own over its parameters (the update is elementwise
// per parameter, so it is the whole optimizer's to the bit); the optimizer state moves into those
// on the first hold and back into the whole optimizer on give_back, where snapshots read and write it.
#pragma once

#include "gpipe/pipeline.h"
#include "gpipe/train.h"

#include <torch/optim/optimizer.h>

#include <map>
#include <memory>
#include <vector>

namespace gpipe::detail {

class StageUpdates {
 public:
  /// Whether `pipeline`'s stages here can each take their own update: no parameter is used by two
  /// stages (a weight tied across stages is updated once, by the whole optimizer).
  static bool possible(const Pipeline& pipeline);

  /// An optimizer of `options` for each stage `pipeline` holds here, over the stage's parameters.
  StageUpdates(const Pipeline& pipeline, const OptimizerOptions& options);

  /// Takes the gradients the parameters hold now (they are left without) as the update to apply
  /// at learning rate `lr`; the first hold after give_back() moves `whole`'s state to the stages.
  /// Nothing may be held already.
  void hold(double lr, torch::optim::Optimizer& whole);
  /// Applies stage `stage`'s share of what is held, once; nothing for a stage without a share or
  /// whose share is applied (a device thread calls it: Pipeline::set_before_stage). Throws
  /// std::runtime_error naming the stage if its optimizer fails, its parameters then part updated.
  void apply(int stage);
  /// Applies every share not yet applied (once every device thread has stopped), and lets go of the
  /// held gradients: nothing is held after it. Every share is tried; the first failure is rethrown.
  void apply_remaining();
  /// apply_remaining(), then moves the optimizer state back to `whole`, also when a share fails:
  /// the parameters and `whole` are then as one update of `whole` would have left them.
  void give_back(torch::optim::Optimizer& whole);
  /// Whether an update is held and not yet applied by apply_remaining().
  bool holding() const { return holding_; }

 private:
  struct Share {
    std::vector<torch::Tensor> parameters;
    std::vector<torch::Tensor> gradients;  // held: the step's, taken from the parameters
    std::unique_ptr<torch::optim::Optimizer> optimizer;
    bool due = false;  // held and not yet applied (each share is written by one thread at a time)
  };
  std::map<int, Share> shares_;  // by stage
  bool holding_ = false;
  bool state_here_ = false;  // the optimizer state lives in the shares' optimizers
};

}  // namespace gpipe::detail
