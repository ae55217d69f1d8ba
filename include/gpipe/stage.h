// stage.h: one stage's layers and what it keeps per micro-batch: forward, backward, and the backward
// split into input gradient (I) and weight gradients (W).
//
// A stage keeps its own autograd graph. Its input is detached, each of its
// floating-point tensors a leaf that requires grad (one tensor, or a tuple:
// tensors.h); its backward runs on the stage's own thread and hands the
// input's gradient upstream, one entry per tensor. No graph ever spans two stages, so the backward of
// stage s never waits on another stage's thread:
//
//      stage s-1                 stage s                          stage s+1
//   ... -> y_{s-1} ==send==> [1] x = recv().detach().requires_grad_()
//                                 y = layers(x)          ==send==> [2]
//                            [4] x.grad()  <==recv== y.backward(g) [3] <== g
//   ... <==send== x.grad()
//
//   [1] the boundary: the only tensors a stage keeps when it re-materializes
//   [2] y.detach() goes on, so the next stage's graph starts fresh
//   [3] the gradient of y arrives from downstream (the last stage uses the loss)
//   [4] the gradient of x goes upstream
//
// The I/W split cuts the graph once more, between the stage's layers: each
// layer l runs on a detached copy a_l of the previous layer's output, so I can
// walk the layers backwards computing only d loss / d a_l (autograd skips the
// weight-gradient products), layer by layer; W later accumulates the
// parameters' gradients. I then W adds up to exactly B:
//
//   a_0 ─layer 0─▶ y_0   a_1 = y_0.detach() ─layer 1─▶ y_1 ... ─▶ y_{L-1} ─▶ loss / send
//   I:   g_{L} = d/dy_{L-1} ... g_1 = d/da_1 = grad(y_0 ← a_1 ...)   (retain each layer's graph)
//   W:   for each layer, the weight-only branches of its graph, from where I left them
//
// Inside a layer, I records the gradient entering each autograd node where a
// weight-only branch leaves the input path, and W starts the engine at those
// nodes (src/runtime/backward_split.h has the diagram). Cost: I and W together do the
// work of B, even for a layer that is many weighted operations (a
// TransformerEncoderLayer); W's engine calls and the graph kept between I and
// W are the overhead. A layer that uses one parameter in two branches falls
// back to W as a backward from the layer's output (its internal graph walked
// again).
#pragma once

#include "gpipe/device.h"
#include "gpipe/pipeline_config.h"
#include "gpipe/schedule.h"
#include "gpipe/tensors.h"

#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace gpipe {
namespace detail {
class WeightBackward;
}  // namespace detail

/// A loss: output and target of a micro-batch → a scalar, reduced by the mean
/// over the batch dimension (so micro-batch i is weighted by bᵢ/N).
using LossFn = std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)>;

/// Why `precision` cannot run on a device of `kind` with this build's torch, "" where it can: torch
/// before 2.4 autocasts a CPU to bfloat16 only (nor multiplies float16 matrices there).
std::string precision_refusal(Precision precision, c10::DeviceType kind);
/// Throws std::invalid_argument with precision_refusal's reason, where there is one.
void check_precision_runs(Precision precision, c10::DeviceType kind);

/// Mean squared error and mean cross-entropy (over every leading position: a
/// classifier's [N, classes], a language model's [N, sequence, vocabulary]), as LossFn.
/// cross_entropy_loss takes class indices (targets of the output's shape without its last
/// dimension; -100 marks a target to ignore, as torch's ignore_index, and the mean is over the
/// others, of the whole mini-batch: the pipeline weighs each micro-batch by its counted targets),
/// or class probabilities (floating-point targets of the output's shape).
torch::Tensor mse_loss(const torch::Tensor& output, const torch::Tensor& target);
torch::Tensor cross_entropy_loss(const torch::Tensor& output, const torch::Tensor& target);

/// An error raised inside a stage, naming the stage, the action and micro-batch.
/// The message names the action and the shape of what it was given, e.g.
/// "gpipe: stage 1 failed in the forward of micro-batch 0 (action 1F0, input
/// [32, 3136]): mat1 and mat2 shapes cannot be multiplied (32x3136 and 3000x256)";
/// what() adds, on the lines after it, the device's program around the action
/// (the executor's, executor.h).
class StageError : public std::runtime_error {
 public:
  /// `operand`: the shape of the action's input (a forward's input, a
  /// backward's output gradient), or empty. `backtrace`: where libtorch raised
  /// the error (its C++ stack), kept apart from the message. `program`: the
  /// device's program around the action, or empty.
  StageError(const Action& action, const std::string& what, const std::string& operand = "",
             std::string backtrace = "", const std::string& program = "");
  const Action& action() const { return action_; }
  /// The message without the program: what the other processes of a job are told.
  const std::string& message() const { return message_; }
  /// libtorch's full report of the failure, stack frames included (empty if it gave none).
  const std::string& backtrace() const { return backtrace_; }

 private:
  Action action_;
  std::string message_;
  std::string backtrace_;
};

/// Everything one step asks of the stages. The driver fills it before the step
/// and reads it after; during the step each stage touches only its own parts.
struct StepData {
  bool training = true;
  std::vector<Tensors> inputs;         ///< micro-batch inputs (a tensor or a tuple), read by stage 0
  std::vector<torch::Tensor> targets;  ///< micro-batch targets, read by the last stage
  std::vector<double> weights;         ///< bᵢ/N per micro-batch (cross_entropy_loss with ignored
                                       ///< targets: its counted targets over the batch's)
  LossFn loss;
  uint64_t seed = 0;                   ///< this step's seed for stochastic layers
  std::vector<torch::Tensor> outputs;  ///< written by the last stage (forward only)
  std::vector<double> losses;          ///< written by the last stage: weighted loss per micro-batch
  /// Whether the first stage keeps the gradient of its input (a caller's input that requires grad),
  /// and where it writes it: per micro-batch, an entry per tensor of the input.
  bool keep_input_gradients = false;
  std::vector<Tensors> input_gradients;
  /// Work each device runs before a stage's first action of the step (its receives included), on
  /// the device's thread and the stage's stream: Pipeline::set_before_stage's. Empty: none.
  std::function<void(int stage)> before_stage;
};

/// A layer that draws random numbers in training without being one of torch::nn's
/// Dropout modules (a TorchScript module whose code calls dropout, say) derives from
/// this too, so that its stage seeds its random stream and replays it when it
/// recomputes the forward.
class RandomLayer {
 public:
  virtual ~RandomLayer() = default;
  /// Whether the layer draws random numbers in training mode.
  virtual bool draws_random_numbers() const = 0;
};

/// Whether `layers` draw random numbers in training: torch::nn's Dropout modules
/// with p > 0, and RandomLayers that say so.
bool draws_random_numbers(const torch::nn::Sequential& layers);

/// The parameters of `model`, each tensor once, in the model's order: a tied
/// weight that two layers register is listed once (Module::parameters() lists it
/// twice, so an optimizer built on that would step it twice).
std::vector<torch::Tensor> unique_parameters(const torch::nn::Module& model);

/// Drops the gradients of `params` (undefined, as zero_grad(set_to_none=true)).
void clear_grads(const std::vector<torch::Tensor>& params);

/// The names of the parameters (or, with `buffers`, the buffers) that two or
/// more layers of `model` share, one group per tensor, e.g. {{"0.weight",
/// "9.weight"}}: what PipelineOptions::tied_parameters declares.
std::vector<std::vector<std::string>> shared_tensors(const torch::nn::Sequential& model, bool buffers = false);

/// The running statistics of a BatchNorm layer: the buffers it normalizes by in evaluation.
struct RunningStatistics {
  torch::Tensor mean;                ///< running_mean, one per channel
  torch::Tensor var;                 ///< running_var (unbiased), one per channel
  torch::Tensor batches;             ///< num_batches_tracked
  std::optional<double> momentum;    ///< std::nullopt: a cumulative average (factor 1/batches)
};

namespace detail {

/// A BatchNorm whose running statistics wait for the end of the step: a layer of the stage
/// (`layer`, its position), or one inside a layer that calls the op gpipe::batch_norm (`layer`
/// kInside; src/runtime/nested_norm.h).
struct DeferredNorm {
  static constexpr size_t kInside = static_cast<size_t>(-1);
  size_t layer;
  RunningStatistics running;
  torch::Tensor count, sum, squares;  // float64, on the layer's device
};

}  // namespace detail

/// A layer that normalizes by batch statistics and keeps running ones without
/// being one of torch::nn's BatchNorm modules (a TorchScript BatchNorm, say)
/// derives from this too, so that its stage can update its running statistics
/// once per mini-batch (PipelineOptions::deferred_batch_norm).
class BatchNormLayer {
 public:
  virtual ~BatchNormLayer() = default;
  /// Its running statistics, if it is a BatchNorm that tracks them; std::nullopt otherwise.
  virtual std::optional<RunningStatistics> running_statistics() = 0;
  /// The name of a BatchNorm inside it (not itself), or "" if it holds none.
  virtual std::string inner_batch_norm() const = 0;
  /// The running statistics of the BatchNorms inside it that defer to their stage (Python's
  /// gpipe.DeferredBatchNorm, whose forward is the op gpipe::batch_norm), in module order.
  virtual std::vector<RunningStatistics> deferring_norms_inside() const { return {}; }
  /// Makes the BatchNorms inside it defer to their stage, where it can (a TorchScript layer
  /// rewrites its code's calls of them into gpipe::batch_norm); inner_batch_norm() then names
  /// those it could not.
  virtual void defer_batch_norms_inside() {}
};

/// `layer`'s running statistics if it is a BatchNorm that tracks them:
/// torch::nn::BatchNorm1d, 2d or 3d built with track_running_stats, or a
/// BatchNormLayer that says so.
std::optional<RunningStatistics> running_statistics(torch::nn::Module& layer);

/// "layer.inner" for the first BatchNorm in training mode that sits inside one of `layers`
/// rather than being one of them, or "" if none does. Its stage cannot see
/// its input, so it cannot defer its running statistics (in evaluation it only reads them).
std::string nested_batch_norm(const torch::nn::Sequential& layers);

/// Which of `layers` change their input in place (ReLU(inplace=True), `x += 1`), found by running
/// them in order, without a graph, on a copy of `x`: entry l is true where layer l changed the tensors
/// it was given. The layers run in the mode they are in (Dropout(inplace=True) changes nothing in
/// evaluation); the caller keeps what they change (BatchNorm's running statistics, the random
/// numbers). Nothing where a layer fails: its own run reports the failure.
std::optional<std::vector<bool>> layers_changing_their_input(const torch::nn::Sequential& layers, const Tensors& x,
                                                             const std::vector<std::string>& names);


/// One stage: a run of consecutive layers, and what each micro-batch keeps
/// between its forward and its backward (the input alone when re-materialized,
/// else the input and the autograd graph).
///
/// Thread: used by one thread at a time (the executor of the device it is placed on).
class Stage {
 public:
  /// Stage `index` of `stages`, running `layers` on `device`. With
  /// `deferred_batch_norm`, its BatchNorm layers normalize each micro-batch by
  /// its own statistics but leave their running statistics alone; the stage
  /// gathers the statistics of every row they see in a step instead, for
  /// update_batch_norm (see batch_norm_statistics).
  Stage(int index, int stages, torch::nn::Sequential layers, Device device, bool deferred_batch_norm = false);

  /// Runs the forward (and its recompute and the loss) in `precision` (PipelineOptions::precision).
  void set_precision(Precision precision) { precision_ = precision; }

  /// Forward of micro-batch i of `input` (ignored on stage 0, which reads the step's input).
  /// Keeps what backward needs; with `recompute`, only the input. With
  /// `split`, records each layer's boundary for a later I and W. Returns the
  /// output to hand on (detached), or, on the last stage, nothing (undefined)
  /// after storing the weighted loss (training) or the output (inference) in `step`.
  Tensors forward(int i, const Tensors& input, bool recompute, bool split, StepData& step);
  /// Full backward of micro-batch i from the gradient of its output (ignored
  /// on the last stage). Returns the gradient of the stage input, one entry per
  /// tensor of it (undefined for one that takes no gradient, or that no gradient reached, as on
  /// one device); nothing on stage 0.
  Tensors backward(int i, const Tensors& output_grad, StepData& step);
  /// The input-gradient half of backward (forward must have run with `split`).
  Tensors input_grad(int i, const Tensors& output_grad, StepData& step);
  /// The weight-gradient half: accumulates the parameters' gradients of micro-batch i.
  void weight_grad(int i);
  /// Drops everything kept for the step.
  void clear();
  /// After the step's work has run (the executor has waited for the stream): the losses a GPU
  /// stage kept on the device, into `step` (read once, not one host wait per micro-batch).
  void finish_step(StepData& step);
  /// The stream the stage computes on: its own on a GPU, none on CPU (see DeviceStream).
  const DeviceStream& stream() const { return stream_; }

  /// The skip connections (skip.h) that cross this stage's edges, each as
  /// (k, name), k its index in the program's skips: `stashed`, stashed in these
  /// layers and popped on a later stage; `popped`, popped here and stashed on
  /// an earlier one. A stage with a Stash or Pop among its layers runs a split
  /// backward as one piece (I the gradients of its inputs, W then a backward
  /// into its parameters), since a skip connection crosses its layers' cuts.
  void set_skips(std::vector<std::pair<int, std::string>> stashed, std::vector<std::pair<int, std::string>> popped);
  /// A skip connection's tensor (before the forward of micro-batch i) or its
  /// gradient (before the backward), from another stage.
  void receive_skip(int i, Channel channel, torch::Tensor tensor);
  /// What the forward of micro-batch i stashed for another stage, or what its
  /// backward computed as the gradient of a tensor another stage stashed.
  torch::Tensor take_skip(int i, Channel channel);

  /// What the stage's deferred BatchNorms saw in training forwards since the
  /// last reset_batch_statistics (recomputed forwards not counted): per
  /// BatchNorm, its layers' in layer order, then those inside its layers in
  /// module order, [rows·positions, Σx per channel, Σx² per channel], in
  /// float64 on the CPU, to be summed over replicas. Undefined without
  /// deferred BatchNorms.
  torch::Tensor batch_norm_statistics() const;
  /// Updates each BatchNorm layer's running statistics once, from the mean and
  /// unbiased variance of all the rows in `statistics` (batch_norm_statistics,
  /// maybe summed over replicas) with its momentum, and its batch count by one.
  /// Layers that saw no rows are left alone.
  void update_batch_norm(const torch::Tensor& statistics);
  /// Forgets the statistics gathered so far.
  void reset_batch_statistics();
  /// A new step: forgets the BatchNorm statistics and the skip bytes counted so far.
  void begin_step();
  /// Bytes of skip connections' tensors and gradients this stage sent to other stages since the step began.
  int64_t skip_bytes() const { return skip_bytes_; }

  int index() const { return index_; }
  bool first() const { return index_ == 0; }
  bool last() const { return index_ == stages_ - 1; }
  torch::nn::Sequential layers() const { return layers_; }
  /// Whether the layers draw random numbers in training (Dropout with p > 0).
  /// Such stages replay the same random stream when they re-materialize.
  bool stochastic() const { return stochastic_; }

 private:
  // What a micro-batch leaves behind between its forward and its backward.
  struct Kept {
    Tensors input;                       // [1] in the diagram
    Tensors output;                      // with its graph, unless re-materialized
    torch::Tensor loss;                  // last stage only, with its graph, unless re-materialized
    bool recompute = false;
    bool split = false;
    std::vector<Tensors> layer_inputs;   // split: a_l, detached, per layer
    std::vector<Tensors> layer_outputs;  // split: y_l, with layer l's graph
    std::vector<std::shared_ptr<detail::WeightBackward>> weight_backward;  // after I: W's share, per weighted layer
    std::map<int, torch::Tensor> skip_inputs;  // by skip connection: what other stages stashed, as leaves
    std::map<int, torch::Tensor> stashed;      // by skip connection: what these layers stashed for other stages
    std::vector<torch::Tensor> roots, root_grads;  // a split backward in one piece: what W runs backward from
  };

  // Runs the layers on `x` (and the loss on the last stage) into `kept`; with
  // `gather`, adds the BatchNorm layers' inputs to their statistics. The skip
  // connections popped here read kept.skip_inputs; those stashed here land in kept.stashed.
  Tensors run_layers(int i, const Tensors& x, bool split, bool gather, Kept& kept, StepData& step);
  Tensors run_chain(int i, const Tensors& x, bool split, bool gather, Kept& kept, StepData& step);
  // Finds which layers change their input in place in the layers' present modes (in_place_), on the
  // first forward in those modes, on micro-batch i's input `x`.
  void find_in_place_layers(int i, const Tensors& x, const Kept& kept, const StepData& step);
  // Each layer's mode (training or evaluation), in order.
  std::vector<bool> layer_modes() const;
  // What backward starts from: the loss or the output with its gradient, and the stashed
  // tensors with theirs (received from the stages that popped them).
  void backward_roots(int i, const Tensors& output_grad, Kept& kept, std::vector<torch::Tensor>& roots,
                      std::vector<torch::Tensor>& grads);
  // After a backward: the gradients of the skip connections' tensors popped here, for their stages.
  void send_skip_gradients(int i, Kept& kept, const std::vector<torch::Tensor>& grads = {});
  // A first stage keeps its input gradient in `step` (StepData::keep_input_gradients) and returns
  // none; another returns it, for the stage before.
  Tensors kept_input_gradient(int i, Tensors input_grad, StepData& step) const;
  torch::Tensor weighted_loss(const torch::Tensor& output, int i, const StepData& step) const;
  uint64_t seed_of(int i, const StepData& step) const;
  Kept& kept(int i);

  int index_;
  int stages_;
  torch::nn::Sequential layers_;
  Device device_;
  Precision precision_ = Precision::kFloat32;
  std::vector<std::string> names_;         // per layer, as errors name it: "layer 3", "layer 'mask'"
  bool stochastic_;
  std::map<int, Kept> kept_;               // by micro-batch
  bool deferred_batch_norm_;
  std::vector<detail::DeferredNorm> norms_;  // with deferred BatchNorm: its layers', in order, then those
                                            // inside its layers (gpipe::batch_norm), in module order
  std::vector<std::pair<int, std::string>> stashed_, popped_;  // skip connections across edges: (k, name)
  bool skips_inside_ = false;              // a Stash or Pop among the layers: split backwards in one piece
  // By the layers' modes (layer_modes: Dropout changes its input in training only), per layer, whether
  // it changes its input in place. Such a layer
  // runs on a copy where its input is kept: the stage's input or a view of it (the caller's data, or
  // what a backward and a re-materialization start from) and, in a split backward, every layer's.
  std::map<std::vector<bool>, std::vector<bool>> in_place_;
  std::map<std::pair<int, int>, torch::Tensor> skip_inbox_, skip_outbox_;  // by (micro-batch, channel)
  int64_t skip_bytes_ = 0;
  DeviceStream stream_;
  std::map<int, torch::Tensor> device_losses_;  // on a GPU: weighted loss per micro-batch, until finish_step
};

}  // namespace gpipe
