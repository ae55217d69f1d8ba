// pipeline_config.h: the one value for a pipeline's shape — its schedule, K, V, M, cut,
// re-materialization and the stage times its V schedule is ordered by — whoever chose it (a name on
// the command line, a task's own, auto's prediction, a resumed file, a cut by cost), and the one
// serializer every copy of it goes through: a checkpoint's record, the words rank 0 sends the other
// ranks, the JSON rows of gpipe plan and Python's dicts.
//
//   const gpipe::PipelineConfig config = plan.config();
//   const std::string words = gpipe::text_of(gpipe::fields_of(config));   // to the other ranks
//   const gpipe::PipelineConfig same = gpipe::config_of(gpipe::fields_of_text(words), "rank 0's choice");
//
// A new field is its member, its line in fields_of and its check in config_of.
#pragma once

#include "gpipe/schedule.h"

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace gpipe {

/// The arithmetic of each stage's forward and its recompute (PipelineOptions::precision).
enum class Precision {
  kFloat32,   ///< float32 throughout
  kBFloat16,  ///< under autocast to bfloat16 for the device's kind; parameters and gradients stay float32
  /// Under autocast to float16, with one loss scale for the whole pipeline (LossScaler, loss_scale.h):
  /// float16 keeps 5 bits of exponent, and small gradients would underflow unscaled.
  kFloat16,
};

/// "fp32", "bf16" or "fp16".
std::string to_string(Precision precision);
/// Parses "fp32", "bf16" or "fp16"; throws std::invalid_argument naming `precision` otherwise.
Precision parse_precision(const std::string& text);
/// Every precision's name: "fp32", "bf16", "fp16".
std::vector<std::string> precision_names();

/// What a pipeline runs: the shape make_plan builds a plan from and the Trainer records in a checkpoint.
struct PipelineConfig {
  ScheduleKind schedule = ScheduleKind::kGPipe;
  int devices = 1;         ///< K
  int virtual_stages = 1;  ///< V, stages per device
  int micro_batches = 1;   ///< M
  std::vector<int> balance;  ///< layers per stage, K·V entries
  Checkpoint checkpoint = Checkpoint::kExceptLast;  ///< re-materialization
  /// Each stage's F, I and W times its V schedule is ordered by (PipelineOptions::stage_times);
  /// empty: the order of equal times.
  std::vector<ActionTimes> stage_times;
  Precision precision = Precision::kFloat32;

  bool operator==(const PipelineConfig& other) const;
  bool operator!=(const PipelineConfig& other) const { return !(*this == other); }
};

/// One field of a serialized value: a whole number, a number, a name, or a list of either kind of number.
using FieldValue = std::variant<int64_t, double, std::string, std::vector<int64_t>, std::vector<double>>;
/// A value's fields by name, in order: what every serializer writes and reads.
using Fields = std::vector<std::pair<std::string, FieldValue>>;

/// `config`'s fields: schedule and checkpoint by name, devices, micro_batches, virtual_stages, balance,
/// precision by name, and stage_times (each stage's F, I and W in one list) where it has any.
Fields fields_of(const PipelineConfig& config);

/// The config `fields` hold (as fields_of writes them; other fields are left for the caller), checked
/// as a pipeline that can run: K, V and M at least 1, a balance of K·V stages of at least one layer
/// each, a schedule that takes that V and that M on that K, and three finite, non-negative times per
/// stage. Throws std::runtime_error naming `what` and the field: "its pipeline has no balance",
/// "its pipeline's devices is 0", "its pipeline cannot have run: ...".
PipelineConfig config_of(const Fields& fields, const std::string& what);

/// The field `name` of `fields`, or nullopt.
const FieldValue* find_field(const Fields& fields, const std::string& name);

/// One field's value as text_of writes it: "8", "zbv", "3,5", a double by its 17 significant digits.
std::string text_of(const FieldValue& value);

/// `fields` as one line of text, every number exact (a double by its 17 significant digits):
/// "schedule=zbv devices=2 ... stage_times=0.0012,0.0011,...". What crosses between ranks.
std::string text_of(const Fields& fields);
/// The fields of text_of's line. Throws std::runtime_error naming `what` for a line it did not write.
Fields fields_of_text(const std::string& text, const std::string& what);

/// "zbv (V=2), M=8" or "gpipe, M=4, checkpoint always, bf16": the config as auto's lines name it (V
/// where above 1, re-materialization where there is any, the precision where not float32).
std::string describe(const PipelineConfig& config);

}  // namespace gpipe
