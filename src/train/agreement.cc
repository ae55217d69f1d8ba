// agreement.cc: what every rank of a job must share, compared by the library from the option values
// themselves: a rank given other settings is named with the setting, before any step.
#include "gpipe/train.h"

#include "gpipe/check.h"
#include "gpipe/digest.h"

#include <torch/torch.h>

#include <functional>
#include <limits>
#include <sstream>

namespace gpipe {
namespace {

template <typename T>
std::string text(const T& value) {
  std::ostringstream out;
  out.precision(17);
  out << value;
  return out.str();
}

// A digest of `value` that a double holds exactly (52 bits), to compare with Pipeline::max; the same
// on every host.
double digest(const std::string& value) {
  const torch::Tensor bytes = torch::from_blob(const_cast<char*>(value.data()),
                                               {static_cast<int64_t>(value.size())}, torch::kUInt8);
  return static_cast<double>(tensors_digest({bytes}) & ((uint64_t{1} << 52) - 1));
}

// TrainerOptions::loss_scale as text: "none", or whether it is on and GradScaler's four settings.
std::string loss_scale_text(const std::optional<LossScaleOptions>& s) {
  if (!s) return "none";
  return text(s->enabled()) + "," + text(s->init_scale()) + "," + text(s->growth_factor()) + "," +
         text(s->backoff_factor()) + "," + text(s->growth_interval());
}

}  // namespace

std::vector<std::pair<std::string, std::string>> settings_of(const TrainerOptions& o) {
  const OptimizerOptions& opt = o.optimizer();
  const LrScheduleOptions& lr = o.lr_schedule();
  const std::string betas = opt.betas() ? text(std::get<0>(*opt.betas())) + "," + text(std::get<1>(*opt.betas())) : "";
  return {{"optimizer", optimizer_name(opt.kind())},
          {"lr", text(opt.lr())},
          {"momentum", text(opt.momentum())},
          {"nesterov", text(opt.nesterov())},
          {"weight_decay", text(opt.decay())},
          {"betas", betas},
          {"lr_schedule", lr_schedule_name(lr.kind())},
          {"warmup_steps", text(lr.warmup_steps())},
          {"lr_step_size", text(lr.step_size())},
          {"lr_gamma", text(lr.gamma())},
          {"clip_grad_norm", text(o.clip_grad_norm())},
          {"batch_size", text(o.batch_size())},
          {"drop_last", text(o.drop_last())},
          {"shuffle", text(o.shuffle())},
          {"seed", text(o.seed())},
          {"epochs", text(o.epochs())},
          {"steps", text(o.steps())},
          {"classification", text(o.classification())},
          {"augment", o.augment() ? "a function" : "none"},
          {"save", o.save()},
          {"save_every", text(o.save_every())},
          {"stop_timeout", text(o.stop_timeout())},
          {"per_device_files", text(o.per_device_files())},
          {"update_on_devices", text(o.update_on_devices())},
          {"loss_scale", loss_scale_text(o.loss_scale())}};
}

void check_same_on_every_rank(Pipeline& pipeline, const std::vector<std::pair<std::string, std::string>>& settings) {
  std::string all;
  for (const auto& [name, value] : settings) all += name + '\0' + value + '\0';
  auto first_rank_differing = [&](double mine) {
    const double first = pipeline.max(pipeline.rank() == 0 ? mine : -1.0);  // the first rank's
    const double rank = mine == first ? std::numeric_limits<double>::max() : static_cast<double>(pipeline.rank());
    return -pipeline.max(-rank);
  };
  if (first_rank_differing(digest(all)) == std::numeric_limits<double>::max()) return;
  // As many settings on every rank, or each would make another number of the collectives below.
  const double counted = first_rank_differing(static_cast<double>(settings.size()));
  GPIPE_CHECK(counted == std::numeric_limits<double>::max(), "the ranks were given different settings: rank ",
              static_cast<int>(counted), " has another number of settings to compare than rank 0; give every rank the "
              "same settings");
  for (const auto& [name, value] : settings) {
    const double rank = first_rank_differing(digest(value));
    GPIPE_CHECK(rank == std::numeric_limits<double>::max(), "the ranks were given different settings: rank ",
                static_cast<int>(rank), "'s `", name, "` is not rank 0's; give every rank the same settings (the same "
                "command line)");
  }
  GPIPE_CHECK(false, "the ranks were given different settings (the same names, in another order); give every rank the "
              "same settings");
}

}  // namespace gpipe
