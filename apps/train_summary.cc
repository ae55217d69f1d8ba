// train_summary.cc: what `gpipe train` reports at its end: the summary, as text or JSON.
#include "common.h"
#include "train.h"

#include <gpipe/gpipe.h>

#include <iomanip>
#include <iostream>

namespace gpipe::cli {
void print_summary(const Outcome& r) {
  const nlohmann::json s = summary_of(r);
  if (r.o.json) {
    std::cout << s.dump(2) << std::endl;
    return;
  }
  const std::string& eval = r.c.data.test_name;
  const int64_t run_steps = r.trainer.step() - r.trainer.start_step();
  std::cout << "\nsummary\n";
  if (run_steps == 0 && r.o.epochs == 0)
    std::cout << "  no step ran (--epochs 0): the checkpoint file's model, at step " << r.trainer.step() << "\n";
  else if (run_steps == 0)
    std::cout << "  no step ran: the checkpoint file is at step " << r.trainer.step() << ", and the run ends at step "
              << r.trainer.total_steps() << "\n";
  if (r.c.task.metric == Metric::kAccuracy)
    std::cout << "  " << eval << " accuracy  " << std::fixed << std::setprecision(2) << 100 * r.evaluation.accuracy
              << "%\n";
  else if (r.c.task.metric == Metric::kPsnr)
    std::cout << "  " << eval << " PSNR      " << std::fixed << std::setprecision(2) << metric_of_loss(Metric::kPsnr, r.evaluation.loss)
              << " dB (noisy input " << r.c.data.noisy_psnr_db << " dB)\n";
  else if (r.c.task.metric == Metric::kBitsPerByte)
    std::cout << "  " << eval << " bits per byte  " << std::fixed << std::setprecision(3)
              << metric_of_loss(Metric::kBitsPerByte, r.evaluation.loss) << " (bigram " << r.c.data.bigram_bits_per_byte << ", gzip -9 "
              << r.c.data.gzip_bits_per_byte << ")\n";
  else
    std::cout << "  " << eval << " loss  " << std::fixed << std::setprecision(6) << r.evaluation.loss << "\n";
  std::cout << format_run_figures({r.trainer.stats().train_seconds, run_steps, s["samples_per_s"].get<double>(),
                                   s["bubble"].get<double>(), r.c.balance, r.trainer.pipeline().plan().placement, r.trainer.pipeline().devices()})
            << std::flush;
  if (!r.o.save.empty())
    std::cout << "  saved to       "
              << (r.o.per_stage_files ? r.trainer.snapshot_file(r.o.save, 0) + " .. " + r.trainer.snapshot_file(r.o.save, r.trainer.pipeline().devices() - 1)
                                     : r.o.save)
              << std::endl;
}

nlohmann::json summary_of(const Outcome& r) {
  const int64_t run_steps = r.trainer.step() - r.trainer.start_step();
  const std::string& eval = r.c.data.test_name;
  nlohmann::json stages = nlohmann::json::array();
  for (int j = 0; j < static_cast<int>(r.c.balance.size()); ++j) {
    stages.push_back({{"stage", j},
                      {"device", r.trainer.pipeline().plan().placement[static_cast<size_t>(j)]},
                      {"layers", r.c.balance[static_cast<size_t>(j)]}});
    if (!job().distributed) {
      nlohmann::json names = nlohmann::json::array();
      const int first = stage_offsets(r.c.balance)[static_cast<size_t>(j)];
      const auto children = r.trainer.pipeline().layers()->children();
      for (int n = first; n < first + r.c.balance[static_cast<size_t>(j)]; ++n)
        names.push_back(children[static_cast<size_t>(n)]->name());
      stages.back()["modules"] = names;
    }
  }
  const nlohmann::json none;  // null: no step ran, so no loss was measured
  nlohmann::json s = {{"evaluated_on", eval},
                      {eval + "_loss", r.evaluation.loss},
                      {"first_loss", run_steps > 0 ? nlohmann::json(r.trainer.stats().first_loss) : none},
                      {"final_loss", run_steps > 0 ? nlohmann::json(r.trainer.stats().last_loss) : none},
                      {"no_step_ran", run_steps == 0},
                      {"train_seconds", r.trainer.stats().train_seconds},
                      {"samples_per_s", r.trainer.stats().samples_per_s()},
                      {"steps", r.trainer.step()},
                      {"steps_this_run", run_steps},
                      {"steps_per_epoch", r.trainer.steps_per_epoch()},
                      {"epochs", r.epochs},
                      {"stages", r.trainer.pipeline().devices()},
                      {"balance", r.c.balance},
                      {"partition", stages},
                      {"plan", r.c.plan},
                      {"micro_batches", r.o.micro_batches},
                      {"checkpoint", r.o.checkpoint},
                      {"schedule", r.o.schedule},
                      {"virtual_stages", r.o.virtual_stages},
                      {"batch_size", r.o.batch_size},
                      {"drop_last", r.o.drop_last},
                      {"shuffle", r.o.shuffle},
                      {"optimizer", r.o.optimizer},
                      {"lr", r.o.lr},
                      {"lr_schedule", r.o.lr_schedule},
                      {"augment", r.o.augment},
                      {"batch_norm", r.o.batch_norm},
                      {"warmup_steps", r.o.warmup_steps},
                      {"weight_decay", r.o.weight_decay},
                      {"clip_grad_norm", r.o.clip_grad_norm},
                      {"seed", r.o.seed},
                      {"bubble", run_steps > 0 ? r.trainer.stats().bubble_sum / static_cast<double>(run_steps) : 0.0},
                      {"parameter_checksum", r.checksum},
                      {"machine", machine()}};
  if (r.o.optimizer == "sgd") {
    s["momentum"] = r.o.momentum;
    s["nesterov"] = r.o.nesterov;
  } else {
    s["betas"] = r.o.betas;
  }
  if (job().distributed) s["mpi"] = {{"ranks", job().size}, {"replicas", job().size / r.trainer.pipeline().devices()}};
  if (r.c.task.metric == Metric::kAccuracy) s[eval + "_accuracy"] = r.evaluation.accuracy;
  if (r.c.task.metric == Metric::kPsnr) {
    s[eval + "_psnr_db"] = metric_of_loss(Metric::kPsnr, r.evaluation.loss);
    s["noisy_" + eval + "_psnr_db"] = r.c.data.noisy_psnr_db;
  }
  if (r.c.task.metric == Metric::kBitsPerByte) {
    s[eval + "_bits_per_byte"] = metric_of_loss(Metric::kBitsPerByte, r.evaluation.loss);
    s["bigram_bits_per_byte"] = r.c.data.bigram_bits_per_byte;
    s["gzip_bits_per_byte"] = r.c.data.gzip_bits_per_byte;
    s["train_bytes"] = r.c.data.train_bytes;
    s["test_bytes"] = r.c.data.test_bytes;
    s["context"] = r.c.data.train.input.size(1);
  }
  if (r.o.generate > 0) {
    s["generated"] = r.generated;
    s["prompt"] = shown_text(r.o.prompt);
    s["temperature"] = r.o.temperature;
  }
  return s;
}

}  // namespace gpipe::cli
