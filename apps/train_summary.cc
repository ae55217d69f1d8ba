// train_summary.cc: what `gpipe train` reports at its end: the library's summary (summarize_run), as
// text or JSON.
#include "common.h"
#include "train.h"

#include <gpipe/gpipe.h>

#include <iomanip>
#include <iostream>

namespace gpipe::cli {

namespace {

// The summary as JSON: the library's figures, and the flags' settings they were run with.
nlohmann::json summary_json(const TrainOptions& o, const TrainingRun& c, const RunSummary& s, const nlohmann::json& epochs,
                            const std::string& generated) {
  const std::string& eval = s.evaluated_on;
  nlohmann::json stages = nlohmann::json::array();
  for (const RunSummary::Stage& stage : s.partition) {
    stages.push_back({{"stage", stage.stage}, {"device", stage.device}, {"layers", stage.layers}});
    if (!job().distributed) stages.back()["modules"] = stage.modules;
  }
  const nlohmann::json none;  // null: no step ran, so no loss was measured
  nlohmann::json plan;        // --balance-by's, else null
  if (c.cost)
    plan = {{"balance_by", o.balance_by}, {"unit", c.cost->unit}, {"stage_costs", c.cost->plan.stage_costs},
            {"bottleneck_stage", c.cost->plan.bottleneck_stage}, {"predicted_step", c.cost->plan.predicted_step},
            {"predicted_efficiency", c.cost->plan.predicted_efficiency}};
  nlohmann::json j = {{"evaluated_on", eval}, {eval + "_loss", s.evaluation.loss},
                      {"first_loss", s.no_step_ran ? none : nlohmann::json(s.first_loss)},
                      {"final_loss", s.no_step_ran ? none : nlohmann::json(s.final_loss)},
                      {"no_step_ran", s.no_step_ran}, {"train_seconds", s.figures.train_seconds},
                      {"samples_per_s", s.figures.samples_per_s}, {"steps", s.steps},
                      {"steps_this_run", s.figures.steps}, {"steps_per_epoch", s.steps_per_epoch}, {"epochs", epochs},
                      {"stages", s.figures.devices}, {"balance", s.figures.balance}, {"partition", stages},
                      {"plan", plan}, {"micro_batches", o.micro_batches}, {"checkpoint", o.checkpoint},
                      {"precision", to_string(c.plan.precision)}, {"schedule", o.schedule}, {"virtual_stages", o.virtual_stages}, {"batch_size", o.batch_size},
                      {"drop_last", o.drop_last}, {"shuffle", o.shuffle}, {"optimizer", o.optimizer}, {"lr", o.lr},
                      {"lr_schedule", o.lr_schedule}, {"augment", o.augment}, {"batch_norm", o.batch_norm},
                      {"warmup_steps", o.warmup_steps}, {"weight_decay", o.weight_decay},
                      {"clip_grad_norm", o.clip_grad_norm}, {"seed", o.seed}, {"bubble", s.figures.bubble},
                      {"loss_scale", s.figures.loss_scale > 0 ? nlohmann::json(s.figures.loss_scale) : none},
                      {"skipped_steps", s.figures.skipped_steps},
                      {"parameter_checksum", s.checksum}, {"transport", s.transport}, {"machine", machine()}};
  if (o.optimizer == "sgd") {
    j["momentum"] = o.momentum;
    j["nesterov"] = o.nesterov;
  } else {
    j["betas"] = o.betas;
  }
  if (c.choice) {
    const double measured = s.figures.steps > 0 ? s.figures.train_seconds / static_cast<double>(s.figures.steps) : 0.0;
    j["auto"] = {{"predicted_step_s", c.choice->predicted.step_s}, {"predicted_bubble", c.choice->predicted.bubble},
                 {"measured_step_s", measured}, {"measured_median_step_s", s.figures.median_step_s},
                 {"measured_bubble", s.figures.bubble},
                 {"order", order_name(c.choice->config.stage_times)},
                 {"configurations", c.choice->considered}, {"fits", c.choice->fits}};
    if (!c.choice->taken_from.empty()) {  // the resumed file's pipeline: nothing predicted
      j["auto"]["taken_from"] = c.choice->taken_from;
      for (const char* predicted : {"predicted_step_s", "predicted_bubble", "configurations", "fits"})
        j["auto"][predicted] = nullptr;
    }
    if (!c.choice->not_as_saved.empty()) j["auto"]["not_as_saved"] = in_flags(c.choice->not_as_saved);
  }
  // `schedule` auto by default, where the model could not be profiled: why, and that the task's own ran.
  if (!c.auto_fallback.empty()) j["auto_fallback"] = in_flags(c.auto_fallback);
  if (job().distributed) j["mpi"] = {{"ranks", job().size}, {"replicas", s.replicas}};
  for (const auto& [name, value] : s.scores) j[name] = value;
  if (c.task.context > 0) {  // text: its bytes and windows
    j["train_bytes"] = c.data.train_bytes;
    j["test_bytes"] = c.data.test_bytes;
    j["context"] = c.data.train.input.size(1);
  }
  if (o.generate > 0) {
    j["generated"] = generated;
    j["prompt"] = shown_text(o.prompt);
    j["temperature"] = o.temperature;
  }
  return j;
}

}  // namespace

void print_summary(const TrainOptions& o, const TrainingRun& c, const RunSummary& s, const nlohmann::json& epochs,
                   const std::string& generated, const std::string& saved_to) {
  if (o.json) {
    std::cout << summary_json(o, c, s, epochs, generated).dump(2) << std::endl;
    return;
  }
  std::cout << "\nsummary\n";
  if (s.no_step_ran && o.epochs == 0)
    std::cout << "  no step ran (--epochs 0): the checkpoint file's model, at step " << s.steps << "\n";
  else if (s.no_step_ran)
    std::cout << "  no step ran: the checkpoint file is at step " << s.steps << ", and the run ends at step "
              << s.total_steps << "\n";
  const RunFigures& f = s.figures;
  std::cout << "  " << c.task.scoring.format(s.evaluation, c.data, /*summary=*/true) << "\n"
            << format_run_figures(f)
            << (c.choice ? format_choice_measured(*c.choice, f.steps, f.train_seconds, f.median_step_s, f.bubble) : "")
            << std::flush;
  if (!saved_to.empty()) std::cout << "  saved to       " << saved_to << std::endl;
}

}  // namespace gpipe::cli
