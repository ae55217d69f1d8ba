// summary.cc: a run of a task as it is reported: its summary (summarize_run), the check of its data
// against the batch and micro-batches, and the error of a loss that diverged.
#include "gpipe/tasks.h"

#include "gpipe/check.h"
#include "gpipe/job.h"
#include "gpipe/partition.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>

namespace gpipe {

RunSummary summarize_run(Trainer& trainer, const Task& task, const TaskData& data, const Evaluation& evaluation,
                         double checksum) {
  Pipeline& pipeline = trainer.pipeline();
  const PipelinePlan& plan = pipeline.plan();
  const TrainStats& stats = trainer.stats();
  RunSummary s;
  const int64_t run_steps = trainer.step() - trainer.start_step();
  s.evaluated_on = data.test_name;
  s.evaluation = evaluation;
  s.transport = pipeline.describe();
  s.no_step_ran = run_steps == 0;
  s.first_loss = stats.first_loss;
  s.final_loss = stats.last_loss;
  s.figures = {stats.train_seconds, run_steps, stats.samples_per_s(),
               run_steps > 0 ? stats.bubble_sum / static_cast<double>(run_steps) : 0.0,
               plan.balance, plan.placement, pipeline.devices(), stats.median_step_s(),
               trainer.loss_scaler() ? trainer.loss_scaler()->scale() : 0.0, stats.skipped_steps};
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
  s.scores = task.scoring.figures(evaluation, data, /*references=*/true);
  return s;
}

void check_run_data(const Task& task, const TaskData& data, int micro_batches, int64_t batch_size) {
  const int64_t N = data.train.size();
  const std::string what = task.context > 0 ? " training windows" : " training samples";
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
