// train.h: what the parts of `gpipe train` share: its flags' values (the library's TrainSettings and
// the flags of the command line only) and the run they chose (the library's TrainingRun).
#pragma once

#include <gpipe/gpipe.h>

#include <nlohmann/json.hpp>

#include <string>

namespace gpipe::cli {

struct TrainOptions : TrainSettings {
  bool json = false;
};

/// Checks the flags, loads the model and the data, chooses the cut, trains (train.cc).
int run_train(TrainOptions o);

/// The summary on standard output: as text, or as JSON with --json (train_summary.cc).
void print_summary(const TrainOptions& o, const TrainingRun& c, const RunSummary& s, const nlohmann::json& epochs,
                   const std::string& generated, const std::string& saved_to);

/// Trains the chosen task, with progress, the evaluation after every epoch, checkpoints, the
/// timeline and the summary; returns the exit status (train_run.cc).
int train_and_report(const TrainOptions& o, const TrainingRun& choice);

}  // namespace gpipe::cli
