// bench_fields.cc: the rows of gpipe bench's flags (settings.h's bench_fields), whose values are the
// library's sweep (BenchSweep). Where bench sweeps a setting of gpipe train, its row is train's.
#include "gpipe/settings.h"

#include "gpipe/schedule.h"

namespace gpipe {
namespace {

std::vector<Field<BenchSweep>> make_bench_fields() {
  using B = BenchSweep;
  std::vector<Field<B>> rows{
      {"workload", "--workload",
       "a benchmark workload (mlp, transformer, tiny, imbalanced) or any built-in task (cnn, resnet, unet, gpt) on "
       "a random batch of its shape; several sweep: mlp,tiny",
       &B::workloads, one_of(task_names(/*workloads=*/true))},
      train_field<B>("devices", &B::stages, "numbers of devices K to sweep (1 2 or 1,2)"),
      train_field<B>("micro_batches", &B::micro_batches, "numbers of micro-batches M to sweep"),
      train_field<B>("checkpoint", &B::checkpoints, "always, except_last, never (several sweep)"),
      train_field<B>("schedule", &B::schedules,
                     "schedules to sweep: " + schedule_help() + "; each later one is also compared with the first, "
                     "step by step; auto: at each K and M, the schedule and V predicted fastest from bench's profile "
                     "(row auto:NAME; under mpirun or torchrun rank 0's choice)",
                     one_of(schedule_choices({"auto"}))),
      train_field<B>("virtual_stages", &B::virtual_stages,
                     "V, stages per device of the schedules that let it be chosen (" + virtual_stages_help() + ")",
                     number_in(2, 64, /*whole=*/true)),
      train_field<B>("threads_per_device", &B::threads, "intra-op threads of each device (and of the one device)"),
      {"steps", "--steps", "timed steps per configuration (the median is reported)", &B::steps, whole_number(1)},
      {"warmup", "--warmup",
       "untimed steps of every configuration before its `steps` timed ones (any number, also more than `steps`: "
       "they warm caches and allocators and are never timed)",
       &B::warmup, whole_number(0)},
      train_field<B>("balance", &B::balance, "an explicit cut, layers per stage: K x V entries (e.g. 3,5)"),
      train_field<B>("balance_by", &B::balance_by,
                     "how stages are cut (several sweep): even (blocks evenly, as docs/benchmarks.md), params "
                     "(parameter counts), time (profiled forward+backward per layer) or memory (activations kept plus "
                     "parameters, gradients and momentum); the exact min-max cut of the stages, or of the devices "
                     "where a schedule puts several stages on one",
                     one_of({"even", "params", "time", "memory"})),
      train_field<B>("precision", &B::precision,
                      "every contender's arithmetic, as gpipe train's `precision` (the one device's forward too)"),
      {"tie_embeddings", "--tie-embeddings",
       "the transformer's output layer reuses its embedding's weight (tied embeddings): one weight on the first and "
       "the last stage, one gradient, one update",
       &B::tie_embeddings, {}},
  };
  for (Field<B>& row : rows)
    row.shows_default = row.name != "virtual_stages" && row.name != "balance" && row.name != "tie_embeddings";
  return rows;
}

}  // namespace

const std::vector<Field<BenchSweep>>& bench_fields() {
  static const std::vector<Field<BenchSweep>> rows = make_bench_fields();
  return rows;
}

}  // namespace gpipe
