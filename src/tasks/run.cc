// run.cc: a run of a task: the one place its pipeline is chosen (the schedule, V and the cut a
// front end's flags ask for, or the task's own), its score as it is printed, and its summary.
#include "gpipe/tasks.h"

#include "gpipe/check.h"
#include "gpipe/cost_model.h"
#include "gpipe/job.h"
#include "gpipe/partition.h"

#include <torch/torch.h>

#include <cmath>
#include <iomanip>
#include <sstream>

namespace gpipe {
namespace {

// The schedule of "auto" and the V of 0: the task's own schedule when the cut is its own too;
// otherwise fill-drain, or interleaved for a V above 1.
RunRequest with_schedule(const Task& task, RunRequest r) {
  if (r.schedule == "auto") {
    const bool own = task.schedule && r.balance.empty() && r.balance_by.empty();
    const auto [kind, V] = own ? task.schedule(r.devices, r.micro_batches) : std::pair{ScheduleKind::kGPipe, 1};
    const bool takes = r.virtual_stages == 0 || takes_virtual_stages(kind, r.virtual_stages);
    r.schedule = to_string(takes ? kind : r.virtual_stages > 1 ? ScheduleKind::kInterleaved : ScheduleKind::kGPipe);
    if (takes && r.virtual_stages == 0) r.virtual_stages = V;
  }
  if (r.virtual_stages == 0) r.virtual_stages = default_virtual_stages(parse_schedule(r.schedule));
  return r;
}

}  // namespace

RunRequest resolve_run(const Task& task, RunRequest request) {
  RunRequest r = with_schedule(task, std::move(request));
  // A model whose layers differ in time by 10x is cut by measured time unless told otherwise (under
  // MPI each rank would profile alone: the task's own cut there).
  if (task.defaults.cut_by_time && r.balance.empty() && r.balance_by.empty() && r.virtual_stages == 1 &&
      r.devices > 1 && !job().distributed)
    r.balance_by = "time";
  return r;
}

CutRequest cut_of(const Task& task, const RunRequest& r) {
  if (!r.balance.empty()) return CutRequest::given(r.balance);
  const CutRequest own = task.cut ? task.cut(r.devices, parse_schedule(r.schedule), r.virtual_stages) : CutRequest::even();
  if (r.balance_by.empty()) return own;
  if (r.balance_by == "even") return own.kind == CutKind::kBlocks ? own : CutRequest::even();
  GPIPE_CHECK(!r.layer_costs.empty(), "the cut by ", r.balance_by, " needs one cost per layer (layer_costs_by, "
              "RunRequest::layer_costs); profile the model first, or ask for the even cut");
  return CutRequest::by_cost(r.layer_costs);
}

RunRequest with_layer_costs(RunRequest r, const torch::nn::Sequential& whole, const CostModel& profile,
                            int64_t rows) {
  if (!r.balance.empty() || r.balance_by.empty() || r.balance_by == "even") return r;
  r.layer_costs = layer_costs_by(r.balance_by, whole, profile, rows);
  return r;
}

PipelineOptions pipeline_options_of(const Task& task, const RunRequest& request) {
  const RunRequest r = with_schedule(task, request);
  return PipelineOptions()
      .devices(r.devices)
      .micro_batches(r.micro_batches)
      .schedule(parse_schedule(r.schedule))
      .virtual_stages(r.virtual_stages)
      .cut(cut_of(task, r));
}

// ---------------------------------------------------------------- the score

std::string format_score(Metric metric, const Evaluation& evaluation, const TaskData& data, bool summary) {
  const std::string& eval = data.test_name;
  const double score = metric_of_loss(metric, evaluation.loss);
  std::ostringstream out;
  out << std::fixed;
  switch (metric) {
    case Metric::kAccuracy:
      out << eval << (summary ? " accuracy  " : " accuracy ") << std::setprecision(2) << 100 * evaluation.accuracy << "%";
      break;
    case Metric::kPsnr:
      out << eval << (summary ? " PSNR      " : " PSNR ") << std::setprecision(2) << score << " dB (noisy input "
          << data.noisy_psnr_db << " dB)";
      break;
    case Metric::kBitsPerByte:
      out << eval << (summary ? " bits per byte  " : " ") << std::setprecision(3) << score
          << (summary ? "" : " bits per byte") << " (bigram " << data.bigram_bits_per_byte << ", gzip -9 "
          << data.gzip_bits_per_byte << ")";
      break;
    case Metric::kLoss:
      out << eval << (summary ? " loss  " : " loss ") << std::setprecision(summary ? 6 : 4) << evaluation.loss;
      break;
  }
  return out.str();
}

std::vector<std::pair<std::string, double>> score_figures(Metric metric, const Evaluation& evaluation,
                                                          const TaskData& data, bool references) {
  const std::string& eval = data.test_name;
  const double score = metric_of_loss(metric, evaluation.loss);
  switch (metric) {
    case Metric::kAccuracy: return {{eval + "_accuracy", evaluation.accuracy}};
    case Metric::kPsnr:
      if (!references) return {{eval + "_psnr_db", score}};
      return {{eval + "_psnr_db", score}, {"noisy_" + eval + "_psnr_db", data.noisy_psnr_db}};
    case Metric::kBitsPerByte:
      if (!references) return {{eval + "_bits_per_byte", score}};
      return {{eval + "_bits_per_byte", score},
              {"bigram_bits_per_byte", data.bigram_bits_per_byte},
              {"gzip_bits_per_byte", data.gzip_bits_per_byte}};
    case Metric::kLoss: return {};
  }
  return {};
}

// ---------------------------------------------------------------- the summary

RunSummary summarize_run(Trainer& trainer, const Task& task, const TaskData& data, const Evaluation& evaluation,
                         double checksum) {
  Pipeline& pipeline = trainer.pipeline();
  const PipelinePlan& plan = pipeline.plan();
  const TrainStats& stats = trainer.stats();
  RunSummary s;
  const int64_t run_steps = trainer.step() - trainer.start_step();
  s.evaluated_on = data.test_name;
  s.evaluation = evaluation;
  s.no_step_ran = run_steps == 0;
  s.first_loss = stats.first_loss;
  s.final_loss = stats.last_loss;
  s.figures = {stats.train_seconds, run_steps, stats.samples_per_s(),
               run_steps > 0 ? stats.bubble_sum / static_cast<double>(run_steps) : 0.0,
               plan.balance, plan.placement, pipeline.devices()};
  s.steps = trainer.step();
  s.total_steps = trainer.total_steps();
  s.steps_per_epoch = trainer.steps_per_epoch();
  s.replicas = job().size / std::max(1, pipeline.devices());
  s.checksum = checksum;
  const std::vector<int> offsets = stage_offsets(plan.balance);
  for (int j = 0; j < plan.stages(); ++j) {
    RunSummary::Stage stage;
    stage.stage = j;
    stage.device = plan.placement[static_cast<size_t>(j)];
    stage.layers = plan.balance[static_cast<size_t>(j)];
    if (!job().distributed) {  // in one process every layer is here, with its name
      const auto children = pipeline.layers()->children();
      for (int n = offsets[static_cast<size_t>(j)]; n < offsets[static_cast<size_t>(j)] + stage.layers; ++n)
        stage.modules.push_back(children[static_cast<size_t>(n)]->name());
    }
    s.partition.push_back(std::move(stage));
  }
  s.scores = score_figures(task.metric, evaluation, data, /*references=*/true);
  return s;
}

void check_run_data(const Task& task, const TaskData& data, int micro_batches, int64_t batch_size) {
  const int64_t N = data.train.size();
  const std::string what = task.metric == Metric::kBitsPerByte ? " training windows" : " training samples";
  GPIPE_CHECK(N > 0, "the training data has no samples");
  GPIPE_CHECK(micro_batches <= N, "`micro_batches` ", micro_batches, " is more than the ", N, what,
              "; every micro-batch needs a sample");
  GPIPE_CHECK(batch_size <= N, "`batch_size` ", batch_size, " is more than the ", N, what, " the data holds; a batch "
              "takes each at most once: give `batch_size` ", N, " or less");
}

std::string divergence_error(const Trainer& trainer, const Evaluation& evaluation, const TaskData& data, int epoch,
                             const std::string& resume) {
  if (std::isfinite(evaluation.loss)) return "";
  std::ostringstream text;
  text << "gpipe: the " << data.test_name << " loss is " << (std::isnan(evaluation.loss) ? "NaN" : "infinite");
  if (epoch == 0)
    return text.str() + " for the model of " + resume + ": the checkpoint holds a diverged model; resume from another";
  const std::string& save = trainer.options().save();
  text << " after epoch " << epoch << " (step " << trainer.step() << "; the last training loss was "
       << trainer.stats().last_loss << "): the model diverged, most likely because the learning rate (`lr` "
       << trainer.options().optimizer().lr() << ") is too high; lower `lr`, or add `clip_grad_norm`";
  if (!save.empty())
    text << "; this epoch is not saved"
         << (trainer.saved_at() >= 0 ? ": " + save + " keeps step " + std::to_string(trainer.saved_at())
                                     : std::string(": nothing was saved"));
  return text.str();
}

}  // namespace gpipe
