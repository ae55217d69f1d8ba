// schedule.cc: `gpipe schedule`: a schedule's step program as a grid, with its simulated bubble and
// peak in-flight micro-batches per device, before anything runs.
#include "commands.h"
#include "flags.h"

#include <gpipe/plan.h>
#include <gpipe/results.h>
#include <gpipe/schedule.h>
#include <gpipe/tasks.h>

#include <iomanip>
#include <iostream>
#include <memory>

namespace gpipe::cli {
namespace {

struct ScheduleOptions {
  std::string schedule = "gpipe";
  int stages = 2;
  int micro_batches = 4;
  int virtual_stages = 0;  // 0: the schedule's own (default_virtual_stages)
  std::string checkpoint = "never";
  bool program = false;
  bool json = false;
};

// gpipe schedule's flags: a schedule's shape, as gpipe train's rows take it.
std::vector<Field<ScheduleOptions>> schedule_fields() {
  using S = ScheduleOptions;
  std::vector<Field<S>> rows{
      {"schedule", "--schedule", schedule_help(), &S::schedule, one_of(schedule_names())},
      train_field<S>("devices", &S::stages, "K, the number of devices"),
      train_field<S>("micro_batches", &S::micro_batches, "M"),
      train_field<S>("virtual_stages", &S::virtual_stages, "V, stages per device (" + virtual_stages_help() + ")"),
      train_field<S>("checkpoint", &S::checkpoint, "always, except_last or never: the recompute flags of `program`"),
      {"program", "--program", "also print each device's lowered program, sends and receives included", &S::program, {}},
  };
  for (Field<S>& row : rows) row.shows_default = row.name != "virtual_stages" && row.name != "program";
  return rows;
}

// Most stage x micro-batch pairs (K x V x M) gpipe schedule shows: a grid of K x V rows and about
// V x M + K slots, a second or two of work. The largest schedules it could make (2^21 pairs) took a
// minute, 4 GB and printed 300 MB that nobody reads. And most cells of the grid: K rows of at most
// 3 actions per stage-micro-batch plus 2K idle slots (K = 8192 and M = 2 are few pairs, but a grid
// of 2 GB that v-half took 90 s to make).
constexpr int64_t kMostShownPairs = int64_t{1} << 16;
constexpr int64_t kMostShownCells = int64_t{1} << 24;

// A bubble with 3 decimals, or as many as it takes not to read as 1.000 (or 0.000) when it is not.
std::string bubble_text(double bubble) {
  int digits = 3;
  while (digits < 9 && ((bubble < 1 && fixed(bubble, digits) == fixed(1, digits)) ||
                        (bubble > 0 && fixed(bubble, digits) == fixed(0, digits))))
    ++digits;
  return fixed(bubble, digits);
}

int run(ScheduleOptions o) {
  PipelineRequest request;
  request.devices = o.stages;
  request.micro_batches = o.micro_batches;
  request.schedule = o.schedule;
  if (o.virtual_stages != 0) request.virtual_stages = o.virtual_stages;
  request = resolve_run(OwnPipeline(), request);
  o.virtual_stages = request.virtual_stages.value_or(0);
  or_usage_error("--virtual-stages " + std::to_string(o.virtual_stages),
                 [&] { check_virtual_stages(parse_schedule(o.schedule), o.virtual_stages); });
  const int64_t pairs = int64_t{o.stages} * o.virtual_stages * o.micro_batches;
  const int64_t slots = 3 * int64_t{o.virtual_stages} * o.micro_batches + 2 * int64_t{o.stages};
  if (pairs <= kMostShownPairs && o.stages * slots > kMostShownCells)
    usage_error("--stages " + std::to_string(o.stages) + " makes a grid of " + std::to_string(o.stages) +
                " rows of up to " + std::to_string(slots) + " slots; gpipe schedule shows at most " +
                std::to_string(kMostShownCells) + " cells: ask for fewer stages (2048 or fewer fit any M it takes)");
  if (pairs > kMostShownPairs)
    usage_error("--stages " + std::to_string(o.stages) + " x --micro-batches " + std::to_string(o.micro_batches) +
                (o.virtual_stages > 1 ? " x " + std::to_string(o.virtual_stages) + " stages per device" : "") +
                " is " + std::to_string(pairs) + " stage x micro-batch pairs; gpipe schedule shows at most " +
                std::to_string(kMostShownPairs) + " (a grid of K x V rows, V x M + K slots wide): ask for fewer. "
                "Fill-drain's bubble at this size is (K-1)/(M+K-1) = " + bubble_text(ideal_bubble(o.stages, o.micro_batches)));
  // The plan of a model of one layer per stage: make_plan resolves and checks K, V and M, and lowers
  // and validates the program, as for any pipeline.
  const PipelinePlan plan = make_plan(o.stages * o.virtual_stages, pipeline_options_of(OwnPipeline(), request)
                                                                        .checkpoint(parse_checkpoint(o.checkpoint)));
  const Schedule& program = plan.training;
  const SimulatedRun run = simulate(program);
  if (o.json) {
    std::cout << json_of(program, run, o.schedule, o.checkpoint) << "\n";
    return 0;
  }
  Schedule compute = program;  // the grid shows the compute actions without --checkpoint's recompute flags
  for (auto& row : compute.actions)
    for (Action& a : row) a.recompute = false;
  std::cout << o.schedule << ": K=" << o.stages << " devices, M=" << o.micro_batches << " micro-batches"
            << (o.virtual_stages > 1 ? ", V=" + std::to_string(o.virtual_stages) + " stages per device" : "")
            << " (one column per time slot; every action takes one slot)\n"
            << format_grid(compute) << std::fixed << std::setprecision(3) << "simulated bubble " << run.bubble
            << " (fill-drain's (K-1)/(M+K-1) = " << ideal_bubble(o.stages, o.micro_batches) << ")\n"
            << "peak in-flight micro-batches per device:";
  for (int p : run.peak_in_flight) std::cout << ' ' << p;
  std::cout << "\n";
  if (o.program) {
    std::cout << "program with checkpoint " << o.checkpoint << " (r: the forward keeps only its input):\n"
              << format_program(program);
  }
  return 0;
}

}  // namespace

void add_schedule_command(CLI::App& app, const std::string& /*command*/, int& status) {
  auto o = std::make_shared<ScheduleOptions>();
  CLI::App* sub = app.add_subcommand("schedule", "print a schedule's step program as a grid, with its simulated "
                                                 "bubble and peak in-flight micro-batches per device");
  const TakeFlags take = add_fields(sub, *o, schedule_fields(), "schedule");
  sub->add_flag("--json", o->json, "one JSON object: the program, its simulated bubble and peaks");
  sub->callback([o, take, &status] {
    take();
    status = run(*o);
  });
}

}  // namespace gpipe::cli
