// cost_model.h: what a configuration costs before it runs: per-layer costs (profiled here, or
// derived from FLOPs for a device gpipe does not have) fed to the schedule simulator, predicting a
// step's time and each device's peak bytes.
//
//   profile_layers(model, micro-batch) ─┐
//   transformer_costs(shape, device) ───┴▶ CostModel ──predict(plan, rows)──▶ Prediction
//                                                                              step_s, bubble,
//                                                                              peak bytes per device
//
// Every figure of a layer is per sample (per row of dim 0), so one profile
// serves any micro-batch size; times are profiled at the micro-batch size the
// pipeline will run, where the per-sample figure is exact.
//
// How peak bytes are predicted. predict() simulates the plan's training program
// (schedule.h) with the layers' times, then replays each device's actions and
// tracks what the device holds, as gpipe's tracking allocator charges it: a
// tensor counts on the device whose thread allocated it until the last
// reference to it goes, wherever that is. What a stage keeps for itself:
//   F (keeps activations): during it, the stage's forward peak; after it, what
//       its layers saved for backward and its output, until its B ends.
//   F (re-materialized): during it, the forward peak without autograd (skip
//       tensors stashed on the stage stay until popped); after it, nothing of
//       its own: its input belongs to the stage that sent it.
//   B:  the forward again first if the F was re-materialized; during it, the
//       stage's backward peak (with the gradients of skip tensors it popped,
//       alive until the backward reaches the stash or the stage's input; on the
//       last stage, the loss's backward).
//   I, W: a forward whose backward is split records every layer's input and
//       output; I keeps what W needs (the inputs, the gradients of outputs of
//       layers with weights, what the graph keeps for W), W frees it. A stage
//       holding a Stash or Pop splits in one piece: W keeps its whole graph.
// What crosses stages follows the program's SEND actions: each tensor sent stays
// on the sending device until the receiving stage is done with it.
//   activation, stashed skip tensor (skip_channel): made by the sender's F; the
//       receiver holds it as its input, or as the tensor it pops, until it lets
//       go of the micro-batch (the end of its B, or of its W when split). A
//       sender whose F kept its activations holds it among them until its B.
//   gradient of a stage input or of a popped skip tensor: made by the sender's B
//       or I; the receiver's B or I uses it, and its W keeps it when the stage
//       splits in one piece or its last layer has weights.
// A device's predicted peak is the largest held total plus the transient of
// the action running at that moment; static bytes (parameters, gradients,
// optimizer state; a tied weight once per device) come on top, as
// Pipeline::DeviceMemory reports them apart.
// Timing decides how many sent tensors are still held at a device's peak: the
// simulation's order, not the threads', may hold one micro-batch's more or less.
#pragma once

#include "gpipe/plan.h"
#include "gpipe/schedule.h"
#include "gpipe/skip.h"
#include "gpipe/stage.h"
#include "gpipe/tensors.h"

#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace gpipe {

/// The costs of one layer, per sample (a row of dim 0) unless named otherwise.
struct LayerCost {
  double forward_s = 0;       ///< forward, with autograd recording
  double backward_s = 0;      ///< full backward (input and weight gradients)
  double input_grad_s = 0;    ///< I: backward to the input only
  double weight_grad_s = 0;   ///< W: the weights' share, after I
  int64_t parameter_bytes = 0;  ///< the layer's parameters (whole, not per sample)
  double kept_bytes = 0;        ///< what its forward keeps for backward, its output included
  /// What it keeps when the next layer of its stage runs on its output: its output
  /// counts only if its own graph or the next layer's saves it (a Linear's output
  /// followed by a ReLU goes once the ReLU has run).
  double chain_kept_bytes = 0;
  int output_tensors = 1;       ///< the tensors of its output (a tuple's): what a boundary after it passes
  double output_bytes = 0;      ///< its output (what crosses a stage boundary after it; if the output is a
                                ///< view of its input, its bytes are the input's, kept by the layer before)
  double forward_peak_bytes = 0;   ///< peak during its forward, above what it held before
  double backward_peak_bytes = 0;  ///< peak during its backward above what it held before
                                   ///< (its kept bytes and the output's gradient), its input's gradient included
  double weight_kept_bytes = 0;    ///< what its graph keeps after its I until its W, beyond its input and the
                                   ///< gradient of its output (which W also keeps, for a layer with parameters)
};

/// A skip connection of the model (skip.h) and the bytes per sample of the tensor it stashes.
struct SkipCost {
  SkipConnection connection;
  double bytes = 0;
};

/// A parameter tensor that several layers use (a tied weight: an input embedding read again by the
/// output projection). Each of those layers counts it in its LayerCost::parameter_bytes; a device
/// holds it once however many of them it runs, and one process steps it once.
struct TiedParameter {
  int64_t bytes = 0;        ///< the tensor's bytes
  std::vector<int> layers;  ///< the layers that use it, in order (two or more, each once)
};

/// A model's layers' costs, and what every parameter byte brings with it.
struct CostModel {
  std::vector<LayerCost> layers;
  std::vector<SkipCost> skips;     ///< the model's skip connections, in skip_connections' order
  std::vector<TiedParameter> tied;  ///< parameters tied across layers, in the order first used
  double loss_kept_bytes = 0;      ///< per sample, what the loss keeps for backward (on the last stage)
  double loss_backward_peak_bytes = 0;  ///< per sample, peak of the loss's backward above that
  /// Bytes of gradient and optimizer state per parameter byte: 1 for plain SGD,
  /// 2 for SGD with momentum, 3 for Adam (two moments).
  double state_per_parameter_byte = 1;
  /// Seconds of the optimizer's update per parameter byte (0: not counted); profile_layers
  /// times the optimizer `state_per_parameter_byte` stands for (1 SGD, 2 SGD with momentum, 3 Adam)
  /// on copies of the parameters.
  double update_s_per_parameter_byte = 0;
  /// Where the update runs: false, after the step on one thread while the devices wait (a Pipeline
  /// user's optimizer); true, each stage's share on its device during the next step, before the
  /// stage's first action, or all of a device's at its start where its program begins with a
  /// receive (the Trainer's TrainerOptions::update_on_devices).
  bool update_on_devices = false;
  /// The link between two devices: a boundary tensor of b bytes takes latency + b / bandwidth
  /// on the sending device (bandwidth 0: sends are free, as between threads).
  double link_latency_s = 0;
  double link_bytes_per_s = 0;
  /// What the pipeline itself adds to the layers' profiled times (0: nothing; profile_model measures
  /// it, calibrate.h's pipeline_overhead): seconds each F, B, I and W takes beyond its layers (the
  /// executor taking it from the program, a device waking for it), and seconds per step (the batch
  /// split and the step started and ended on every device).
  double action_overhead_s = 0;
  double step_overhead_s = 0;

  int layer_count() const { return static_cast<int>(layers.size()); }
};

/// How profile_layers measures, set with chainable setters; the defaults profile a model for plain
/// SGD with one warm-up and 3 timed passes on one thread:
///
///   gpipe::profile_layers(model, micro_batch, gpipe::ProfileLayersOptions().threads(4).loss(mse_loss).target(y))
struct ProfileLayersOptions {
  /// Intra-op threads (and OpenBLAS threads, as a stage runs) the layers are profiled with.
  TORCH_ARG(int, threads) = 1;
  /// As in CostModel: 1 SGD, 2 SGD with momentum, 3 Adam; the update is timed with that optimizer.
  TORCH_ARG(double, state_per_parameter_byte) = 1;
  /// Untimed passes first, then timed ones (each figure the median of the timed).
  TORCH_ARG(int, warmup) = 1;
  TORCH_ARG(int, repetitions) = 3;
  /// With the sample's `target`, the loss's bytes are profiled too (the last stage holds them).
  TORCH_ARG(LossFn, loss) = nullptr;
  TORCH_ARG(torch::Tensor, target) = {};
  /// For a model whose input is a tuple: the positions of the sample's tensors taken whole
  /// (PipelineOptions::whole_inputs); the first tensor not named gives the rows.
  TORCH_ARG(std::vector<int>, whole) = {};
  /// Micro-batches passed at once, every forward before the backwards, as a schedule holds them.
  TORCH_ARG(int, in_flight) = 1;
  /// Run before each repetition and before the update is timed (a front end checks for an
  /// interrupt there; what it throws ends the profile). Empty: nothing.
  TORCH_ARG(std::function<void()>, between) = nullptr;
  /// The arithmetic of the forwards (and the loss): under bf16 or fp16 each runs under its device's
  /// autocast, as a stage runs it (PipelineOptions::precision), so times and bytes are that precision's.
  TORCH_ARG(Precision, precision) = Precision::kFloat32;
};

/// Profiles every layer of `model` on the calling thread with `options.threads()` intra-op
/// threads: `sample` (a micro-batch) passes through the layers in order,
/// `warmup` untimed and `repetitions` timed passes, each time the median; bytes
/// come from gpipe's tracking allocator on the last pass, with what each skip
/// connection (skip.h) stashes. I and W are timed with
/// gpipe's split backward. The model is left as it was found: its parameters' gradients,
/// its buffers (BatchNorm's running statistics) and the default CPU generator's state.
/// With a `loss` and the sample's `target`, the loss's bytes are profiled too.
/// A model whose input is a tuple takes `sample` as one (Tensors::tuple_of); its first tensor
/// not named in `whole` gives the rows. Layers that pass tuples
/// are profiled as they run in a stage (tensors.h). With `in_flight` above 1 the times are taken
/// over that many passes of `sample` at once, every forward before the backwards, as a schedule holds
/// its micro-batches: a layer then finds less of its data in cache than when one micro-batch's
/// backward follows its forward (the main job's ResNet at M=8 on one device: predicted 22% under the
/// measured step with 1, 5% with 8). Throws std::invalid_argument for options out of range.
CostModel profile_layers(const torch::nn::Sequential& model, const Tensors& sample,
                         const ProfileLayersOptions& options = {});

/// `costs` with every layer's compute (forward, backward, I and W) `factor` times as long: a device
/// that much slower. The update and the bytes stay.
CostModel with_compute_scaled(CostModel costs, double factor);

/// Seconds of a ring all-reduce of `bytes` among `holders` devices over the link of `costs`: 2(n-1)
/// steps, each a latency and bytes/n (0 for fewer than two holders; the bytes free between threads).
double ring_all_reduce_s(const CostModel& costs, double bytes, int holders);

/// Per-layer costs for balance_by_cost on micro-batches of `rows` rows: each
/// layer's forward plus backward time, in seconds.
std::vector<double> layer_times(const CostModel& costs, int64_t rows);
/// Per-layer costs for balance_by_cost on micro-batches of `rows` rows: the
/// bytes each layer keeps for backward plus its parameters with their
/// gradients and optimizer state (CostModel::state_per_parameter_byte).
std::vector<double> layer_memory(const CostModel& costs, int64_t rows);

/// The per-layer costs a cut by `method` balances (balance_by_cost), on micro-batches of `rows`
/// rows: "params", parameter_costs(model); "time", layer_times(profile, rows); "memory",
/// layer_memory(profile, rows). `profile` is profile_layers' of `model` (not read for "params").
/// Throws std::invalid_argument for another method.
std::vector<double> layer_costs_by(const std::string& method, const torch::nn::Sequential& model,
                                   const CostModel& profile, int64_t rows);
/// The unit of those costs: "parameters", "s" or "bytes"; throws std::invalid_argument for
/// another method.
std::string cost_unit(const std::string& method);

/// What predict() expects of a configuration.
struct Prediction {
  double step_s = 0;   ///< the simulated step plus one optimizer update of every parameter on one
                       ///< thread (as a Pipeline user's optimizer runs); with update_on_devices, the
                       ///< simulated step with each stage's update in it. A weight tied across
                       ///< devices adds the sum of its copies' gradients (ring_all_reduce_s); the
                       ///< pipeline's own overhead (CostModel::step_overhead_s) is in it.
  double bubble = 0;   ///< the simulated idle share, as SimulatedRun::bubble
  /// Per device: peak bytes above what it held before the step (activations,
  /// boundary tensors, backward buffers), what Pipeline::memory()'s peak_bytes measures.
  std::vector<int64_t> peak_bytes;
  /// Per device: parameters, their gradients and the optimizer state.
  std::vector<int64_t> static_bytes;
  /// Per device: static_bytes + peak_bytes, what a device of that size needs.
  std::vector<int64_t> total_bytes() const;
  /// The device needing the most (total_bytes); -1 for an empty prediction.
  int largest_device() const;
  /// That device's total bytes (0 for an empty prediction).
  int64_t largest_total_bytes() const;
};

/// Predicts a step of `plan` (its cut and its training program) for the
/// model of `costs` with micro-batches of `micro_batch_rows` rows (M entries).
/// Throws std::invalid_argument if the plan, the costs and the rows do not fit
/// together (the layers, M, a skip connection the costs do not have).
Prediction predict(const CostModel& costs, const PipelinePlan& plan, const std::vector<int64_t>& micro_batch_rows);

/// Each stage's F, I and W of a micro-batch of `rows` rows under the cut `balance`, as predict
/// charges them (a stage's layers' times, a re-materialized F again inside I unless `mode` is never,
/// the pipeline's own overhead on each): the times the V schedules order by (PipelineOptions::
/// stage_times). The order comes before lowering decides which forwards keep their activations, so
/// under except_last every I is charged its F again (predict charges it only where it runs).
/// Throws std::invalid_argument for a balance that does not cut the costs' layers, or `rows` under 1.
std::vector<ActionTimes> stage_action_times(const CostModel& costs, const std::vector<int>& balance, int64_t rows,
                                            Checkpoint mode);

/// A Transformer as gpipe plan takes it: an embedding, `layers` encoder blocks
/// (self-attention and a feed-forward of `ffn` with ReLU, post-norm, as
/// libtorch's TransformerEncoderLayer), and a projection to the vocabulary.
struct TransformerShape {
  int64_t layers = 0, width = 0, heads = 0, ffn = 0, vocab = 0, sequence = 0;
  int64_t bytes_per_value = 4;  ///< 4 for float32, 2 for half precision (the whole model: parameters too)
  /// The stages' arithmetic: under bf16 or fp16 autocast an activation takes 2 bytes a value (the
  /// parameters keep bytes_per_value).
  Precision precision = Precision::kFloat32;
  /// Parameters of one encoder block.
  int64_t block_parameters() const;
  /// Parameters of the whole model (embedding, blocks, projection).
  int64_t parameters() const;
};

/// A device gpipe has no profile of: how fast it computes.
struct DeviceSpec {
  double flops_per_s = 0;  ///< sustained on the model's matrix products
};

/// Costs of the Transformer `shape` on `device`, from FLOPs (forward 2 per
/// multiply-add, backward twice the forward, I and W half the backward each)
/// and from bytes per sample measured on libtorch's TransformerEncoderLayer in
/// float32 (docs/giant-models.md gives the formula), scaled by bytes_per_value.
/// Layer 0 is the embedding, layers 1..L the blocks, layer L+1 the projection.
CostModel transformer_costs(const TransformerShape& shape, const DeviceSpec& device,
                            double state_per_parameter_byte = 3);

/// Bytes as text for messages: "512 B", "41.2 MiB", "16.0 GiB".
std::string format_bytes(double bytes);

/// Parses "16GiB", "512MiB", "1.5GB", "4096" (bytes); throws std::invalid_argument naming the text.
int64_t parse_bytes(const std::string& text);

}  // namespace gpipe
