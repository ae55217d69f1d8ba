// resumed.cc: which pipeline a resumed run gets under "auto": the one its checkpoint file was trained
// with where the run is the one that saved it, so that it repeats the unbroken run; else the choice
// is predicted again, with the reasons why not.
#include "gpipe/choose.h"

#include <numeric>
#include <sstream>
#include <string>
#include <vector>

namespace gpipe {

std::optional<ScheduleChoice> resumed_choice(const PipelineRequest& r, const ResumedRun& run,
                                             std::string& not_as_saved) {
  const PipelineConfig& saved = run.saved;
  const int layers = std::accumulate(saved.balance.begin(), saved.balance.end(), 0);
  std::vector<std::string> differs;  // every setting the file's pipeline does not meet
  auto say = [&differs](const auto&... parts) {
    std::ostringstream out;
    (out << ... << parts);
    differs.push_back(out.str());
  };
  if (r.devices && *r.devices != saved.devices) say("`devices` ", *r.devices, " differs from its ", saved.devices);
  // (By time is auto's own cut, which the file's is.)
  if (!r.balance_by.empty() && r.balance_by != "time") say("`balance_by` ", r.balance_by, " asks for a new cut");
  if (!r.balance.empty() && r.balance != saved.balance)
    say("`balance` ", format_cut(r.balance), " differs from its ", format_cut(saved.balance));
  if (r.micro_batches && *r.micro_batches != saved.micro_batches)
    say("`micro_batches` ", *r.micro_batches, " differs from its ", saved.micro_batches);
  if (r.virtual_stages.value_or(0) != 0 && *r.virtual_stages != saved.virtual_stages)
    say("`virtual_stages` ", *r.virtual_stages, " differs from its ", saved.virtual_stages);
  if (r.precision && *r.precision != saved.precision)  // its arithmetic: the run would not repeat the unbroken one
    say("`precision` ", to_string(*r.precision), " differs from its ", to_string(saved.precision));
  if (run.saved_batch != run.batch) {
    if (run.batch == run.batch_size)
      say("`batch_size` ", run.batch, " differs from its ", run.saved_batch);
    else  // the training set is smaller than the batch asked for
      say("the batch of ", run.batch, " rows (every training sample) differs from its ", run.saved_batch);
  }
  if (layers != run.layers)
    say("its cut ", format_cut(saved.balance), " holds ", layers, " layers, the model ", run.layers);
  if (!differs.empty()) {
    not_as_saved = run.file + " was trained otherwise: ";
    for (size_t n = 0; n < differs.size(); ++n) not_as_saved += (n ? "; " : "") + differs[n];
    return std::nullopt;
  }
  ScheduleChoice choice;
  // The order it ran in (a tied weight's gradients are summed in it), and the run's own
  // re-materialization, which changes no result.
  choice.config = saved;
  if (r.checkpoint) choice.config.checkpoint = *r.checkpoint;
  choice.chose_micro_batches = !r.micro_batches;
  choice.taken_from = run.file;
  return choice;
}

}  // namespace gpipe
