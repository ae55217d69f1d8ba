// train.cc: `gpipe train`'s choices: the flags checked and completed with the task's own, the
// model, the data and the cut chosen (the library's resolve_training and prepare_training); then
// train_run.cc trains and reports.
#include "common.h"
#include "train.h"

#include <gpipe/gpipe.h>

#include <iostream>

namespace gpipe::cli {

int run_train(TrainOptions o) {
  // Before any file is read: the built-in task, or for a model file the CNN's run (its data and
  // defaults); with --data, trained and scored on that file.
  const Task known = known_task(o);
  resolve_training(o, known);
  const bool quiet = o.json || !job().prints();
  const TrainingRun c = prepare_training(o, known, [quiet] {
    if (!quiet) std::cout << "schedule auto: profiling the layers to choose the pipeline (--schedule task or another "
                             "schedule named skips this)" << std::endl;
  });  // with --schedule auto, `o` takes the choice
  if (c.choice && !quiet) std::cout << in_flags(format_choice(*c.choice)) << "\n";
  if (!c.auto_fallback.empty() && job().prints()) std::cerr << "gpipe: " << in_flags(c.auto_fallback) << "\n";
  if (c.cost && !quiet)
    std::cout << "balance by " << o.balance_by << ":\n" << format_plan(c.cost->plan, c.cost->unit);
  return train_and_report(o, c);
}

}  // namespace gpipe::cli
