// train_flags.cc: `gpipe train`'s flags, their help and their checks that need no file.
#include "commands.h"
#include "flags.h"
#include "train.h"

#include <CLI/CLI.hpp>

#include <csignal>
#include <memory>
#include <string>

namespace gpipe::cli {

void add_train_command(CLI::App& app, const std::string&, int& status) {
  auto o = std::make_shared<TrainOptions>();
  CLI::App* sub = app.add_subcommand(
      "train", "Train through a GPipe pipeline: a CNN on Fashion-MNIST by default, or --model/--data from Python");
  const TakeFlags take = add_fields(sub, *o, train_settings(), "train");
  sub->add_flag("--json", o->json, "print the summary as JSON on standard output (progress stays on standard error)");
  sub->callback([o, take, &status] {
    // A closed standard output (gpipe train ... | head) stops the printing, not the training; SIGINT
    // and SIGTERM end the run, no half-written file left (with --save, train_run.cc stops it saved).
    std::signal(SIGPIPE, SIG_IGN);
    install_signal_handlers(OnSignal::kEndNow);
    o->given.clear();  // what the command line names, whatever the library's defaults take as given
    for (const std::string& name : take()) o->given.insert(name);
    status = run_train(*o);
  });
}

}  // namespace gpipe::cli
