// results.h: what gpipe's commands print as JSON, one object per line, and the result files of
// gpipe bench: a configuration's row (BenchRow), a message size's timing (LinkTiming), a planned
// configuration (PlanCandidate), a schedule's program; the file with the command, date and machine.
#pragma once

#include <gpipe/job.h>
#include <gpipe/planner.h>
#include <gpipe/schedule.h>
#include <gpipe/tasks.h>

#include <string>
#include <vector>

namespace gpipe {

/// One JSON object, on one line: the row of gpipe bench --json (BenchRow's names; the baselines and
/// the comparison with a first schedule where the row has them).
std::string json_of(const BenchRow& row);
/// One message size of gpipe bench --transport --json: bytes, repeats, one_way_us (min, max), gb_per_s.
std::string json_of(const LinkTiming& timing);
/// One configuration of gpipe plan --json: stages, replicas, micro_batches, schedule, ..., fits.
std::string json_of(const PlanCandidate& candidate);
/// gpipe schedule --json: the lowered `program` of schedule `name` with checkpoint mode
/// `checkpoint`, and its simulation `run` (makespan in slots, bubble, peak in flight per device).
std::string json_of(const Schedule& program, const SimulatedRun& run, const std::string& name,
                    const std::string& checkpoint);

/// Cores, CPU, BLAS (its kernel, who chose it, the best for the CPU, its GFLOP/s on one thread), memory
/// allocator, libtorch version and CUDA: the machine of a result file, a JSON object.
std::string machine_json();

/// Refuses, before the work, a result file write_results could not write: makes its folder, as
/// write_results would, and checks it takes the file. Throws std::runtime_error naming the folder
/// or file, the system's reason and what to do. An empty `path`: nothing is written, nothing checked.
void check_results_path(const std::string& path);

/// Writes `rows` (JSON objects, as json_of makes them) to `path` whole or not at all (its folder
/// made), with the command, the date and the machine; says so on standard error. An empty `path`:
/// nothing.
void write_results(const std::string& path, const std::vector<std::string>& rows, const std::string& command);

}  // namespace gpipe
