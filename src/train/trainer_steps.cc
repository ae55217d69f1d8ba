// trainer_steps.cc: the Trainer's step loop (fit: epochs, a stop request honoured at a step
// boundary, saves along the way) and one step with its guards (a non-finite loss stops before the
// update, clipping, the learning rate of the step, the update held for the devices), evaluation,
// and the figures a run reports.
#include "gpipe/train.h"

#include "gpipe/io.h"
#include "train/stage_updates.h"
#include "train/trainer_parts.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iomanip>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace gpipe {

double TrainStats::median_step_s() const {
  if (step_seconds.empty()) return 0.0;
  std::vector<float> sorted = step_seconds;
  const size_t half = sorted.size() / 2;
  std::nth_element(sorted.begin(), sorted.begin() + static_cast<std::ptrdiff_t>(half), sorted.end());
  const double upper = sorted[half];
  if (sorted.size() % 2 == 1) return upper;
  return (upper + *std::max_element(sorted.begin(), sorted.begin() + static_cast<std::ptrdiff_t>(half))) / 2;
}

void Trainer::finish_held_update() {
  if (!stage_updates_) return;
  const int64_t begin = now_ns();
  const bool held = stage_updates_->holding();
  stage_updates_->give_back(*optimizer_);
  if (held) stats_.train_seconds += static_cast<double>(now_ns() - begin) * 1e-9;
}

void Trainer::fit(const TrainerCallbacks& callbacks) {
  const int64_t N = train_.size(), B = options_.batch_size();
  stopped_by_ = 0;
  // Updates held for the devices are applied, and their state given back, however fit() ends.
  in_fit_ = true;
  struct Finish {
    Trainer& t;
    ~Finish() {
      t.in_fit_ = false;
      try {
        t.finish_held_update();
      } catch (...) {  // an exception already on its way is the one to report
      }
    }
  } finish{*this};
  // A stop request is honoured at a step boundary that every rank reaches: saved, then return.
  auto stop_here = [this] {
    stopped_by_ = agreed_stop();
    if (stopped_by_ != 0) save();
    return stopped_by_ != 0;
  };
  if (stop_here()) return;
  for (int epoch = static_cast<int>(step_ / steps_per_epoch_) + 1; step_ < total_steps_; ++epoch) {
    // A fit() after one that stopped draws the epoch it stopped in again, from its start.
    if (drawn_epoch_ == epoch - 1) shuffle_.set_state(epoch_start_shuffle_);
    epoch_start_shuffle_ = detail::generator_state(shuffle_);
    const torch::Tensor order = options_.shuffle() ? torch::randperm(N, shuffle_, torch::kLong) : torch::arange(N);
    drawn_epoch_ = epoch - 1;
    for (int64_t b = step_ % steps_per_epoch_; b < steps_per_epoch_ && step_ < total_steps_; ++b) {
      if (callbacks.before_step) {
        finish_held_update();
        callbacks.before_step(step_);
      }
      try {
        train_step(order.narrow(0, b * B, std::min(B, N - b * B)), epoch);
      } catch (const Interrupted&) {  // abandoned after a stop request: the parameters are as they were
        if (stop_requested() == 0) throw;
        stopped_by_ = stop_requested();
        save();
        return;
      }
      if (callbacks.progress) callbacks.progress(epoch, b + 1);
      if (callbacks.after_step) {
        finish_held_update();
        callbacks.after_step(epoch, b + 1);
      }
      if (options_.save_every() > 0 && step_ % options_.save_every() == 0) save();
      if (stop_here()) {
        // A stop after an epoch's last step: the epoch is whole, so its evaluation follows the save,
        // as in an unbroken run (which a resumed one continues from the next epoch).
        finish_held_update();
        if (b + 1 == steps_per_epoch_ && callbacks.after_epoch) callbacks.after_epoch(epoch);
        return;
      }
    }
    finish_held_update();
    if (callbacks.after_epoch) callbacks.after_epoch(epoch);
    save();
  }
  save();
  finish_held_update();
}

double Trainer::train_step(const torch::Tensor& rows, int epoch) {
  torch::Tensor x = train_.input.index_select(0, rows);
  if (options_.augment()) x = options_.augment()(x, rows, epoch);
  const torch::Tensor y = train_.target.index_select(0, rows);
  const int64_t begin = now_ns();
  clear_grads(pipeline_->parameters());  // the step writes fresh ones
  if (fault_.kind == "exit" && fault_.rank == pipeline_->rank() && fault_.step == step_) std::_Exit(3);
  const LossFn injected = [](const torch::Tensor&, const torch::Tensor&) -> torch::Tensor {
    throw std::runtime_error("injected fault in the loss (GPIPE_TEST_FAULT)");
  };
  const bool inject = fault_.kind == "throw" && fault_.step == step_;
  double loss = 0;
  try {
    loss = pipeline_->train_step(x, y, inject ? injected : options_.loss(), scaler_ ? scaler_->scale() : 1.0)
               .item<double>();
  } catch (...) {
    // The update of the step before is applied whole: the parameters as they were before this step.
    if (stage_updates_) {
      try {
        stage_updates_->apply_remaining();
      } catch (...) {  // the step's own error is the one to report
      }
    }
    throw;
  }
  if (stage_updates_) stage_updates_->apply_remaining();  // a share no action of this step reached
  if (fault_.kind == "inf" && fault_.rank == pipeline_->rank() && fault_.step == step_) inject_infinite_gradient();
  if (finite_step(loss, epoch))
    update();
  else  // skipped on every stage and rank: the parameters as they were
    ++stats_.skipped_steps;
  const double took = static_cast<double>(now_ns() - begin) * 1e-9;
  stats_.train_seconds += took;
  stats_.step_seconds.push_back(static_cast<float>(took));
  if (stats_.samples == 0) stats_.first_loss = loss;
  stats_.last_loss = loss;
  stats_.bubble_sum += pipeline_->bubble();
  stats_.samples += x.size(0);
  ++step_;
  return loss;
}

void Trainer::update() {
  if (options_.clip_grad_norm() > 0) pipeline_->clip_gradients(options_.clip_grad_norm());
  const double lr =
      learning_rate(options_.optimizer().lr(), lr_schedule_, step_, total_steps_);
  if (!(lr <= std::numeric_limits<float>::max())) {  // the parameters are float: the update would overflow
    std::ostringstream text;
    text << "gpipe: the learning rate of step " << step_ + 1 << " is " << lr
         << ", beyond float's range (3.4e38); lower `lr`"
         << (options_.lr_schedule().kind() == LrSchedule::kStep ? " or `lr_gamma`" : "");
    throw std::runtime_error(text.str());
  }
  if (stage_updates_ && in_fit_) {
    stage_updates_->hold(lr, *optimizer_);  // applied on the devices during the next step
  } else {
    for (auto& group : optimizer_->param_groups()) group.options().set_lr(lr);
    optimizer_->step();
  }
}

bool Trainer::finite_step(double loss, int epoch) {
  // One decision for every stage and rank (the loss is the same on all of them; the scaler agrees
  // on the gradients): with a loss scale, a step whose gradients overflow is skipped and the scale
  // backs off; a loss that is not finite stops the run, the parameters as they were.
  const bool loss_finite = std::isfinite(loss);
  if (scaler_ && scaler_->check_and_update(*pipeline_, loss_finite)) return true;
  if (!scaler_ && loss_finite) return true;
  if (scaler_ && loss_finite) return false;
  throw std::runtime_error("gpipe: the loss became " + std::string(std::isnan(loss) ? "NaN" : "infinite") +
                           " in step " + std::to_string(step_ + 1) + " (epoch " + std::to_string(epoch) +
                           "): training stops with the parameters of step " + std::to_string(step_) +
                           (saved_at_ >= 0 ? ", and the last checkpoint file (step " + std::to_string(saved_at_) +
                                                 ") is kept"
                                           : "") +
                           (pipeline_->plan().precision == Precision::kFloat16
                                ? ": under `precision` fp16 the forward may overflow float16 (its largest value is "
                                  "65504), which no loss scale mends; train in bf16 or fp32"
                            : step_ == 0 ? ": no update was applied yet, so the learning rate is not the cause: the "
                                           "model's outputs or the loss on this data overflow float; scale the data "
                                           "(inputs and targets) down"
                                         : "; lower `lr`, or add `clip_grad_norm`"));
}

void Trainer::inject_infinite_gradient() {
  const std::vector<torch::Tensor> parameters = pipeline_->parameters();
  for (auto p = parameters.rbegin(); p != parameters.rend(); ++p)
    if (p->grad().defined()) {
      torch::NoGradGuard no_grad;
      p->mutable_grad().view(-1)[0].fill_(std::numeric_limits<float>::infinity());
      return;
    }
}

Evaluation Trainer::evaluate(const Dataset& data) {
  finish_held_update();
  return pipeline_->evaluate(data.input, data.target, options_.loss(), options_.classification());
}

std::string format_run_figures(const RunFigures& f) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(1) << "  training time  " << f.train_seconds << " s (" << f.steps
      << " steps)\n"
      << std::setprecision(0) << "  throughput     " << f.samples_per_s << " samples/s\n"
      << std::setprecision(1) << "  bubble         " << 100 * f.bubble << "% of device time idle (measured)\n";
  if (f.loss_scale > 0)
    out << std::defaultfloat << std::setprecision(6) << "  loss scale     " << f.loss_scale << " at the end; "
        << std::fixed << f.skipped_steps
        << (f.skipped_steps == 1 ? " step" : " steps") << " skipped (gradients not finite)\n";
  out
      << "  partition      ";
  const bool name_devices = static_cast<int>(f.balance.size()) > f.devices;
  for (size_t j = 0; j < f.balance.size(); ++j)
    out << (j ? " | " : "") << "stage " << j
        << (name_devices && j < f.placement.size() ? " (device " + std::to_string(f.placement[j]) + ")" : "")
        << ": " << f.balance[j] << (f.balance[j] == 1 ? " layer" : " layers");
  out << "\n";
  return out.str();
}

}  // namespace gpipe
