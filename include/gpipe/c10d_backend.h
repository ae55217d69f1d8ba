// c10d_backend.h: the c10d backend (a process per device over torch.distributed's c10d and Gloo;
// docs/distributed.md) started over a store the caller has, such as a torch.distributed process
// group's, instead of the env:// variables torchrun sets (MASTER_ADDR, MASTER_PORT, RANK,
// WORLD_SIZE). Available when gpipe is built with GPIPE_C10D (the macro GPIPE_HAS_C10D is then 1).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <functional>
#include <string>
#include <vector>

namespace gpipe::c10d {

/// Starts the c10d backend for the rest of the process as process `rank` of `size`, over `store`:
/// the same store on every process of the job (a process group's: Python's GPipe(process_group=)
/// gives it), whose keys gpipe keeps under its own prefix and `scope`, which tells apart groups that
/// share a store (torch.distributed's groups share the default group's; Python passes the group's
/// ranks). Pipelines made after it with Runtime::kC10d (or kAuto) run over it. A call with the
/// same store, scope, rank and size does nothing; with others (a group made after the one before
/// was destroyed) it is collective: every rank of the group calls it, and each says in the new store
/// whether it takes it; the backend lets go of the store before and starts over the new one, where no
/// pipeline of this process runs over the one before. Throws std::invalid_argument for a rank
/// outside the processes, while a pipeline of this process still runs over another store (every
/// pipeline of a process uses the same one), in a job torchrun started, whose store is the
/// process's for good, or as soon as another rank says it cannot take the new store for one of
/// these reasons (naming it); a rank that never calls it is waited for up to GPIPE_TIMEOUT. Call it
/// from one thread, with no pipeline being made. job() (job.h) stays a
/// job of one process: its calls across the ranks (check_same_settings, end_job) are for jobs a
/// launcher started. `known_as`, one number per rank or none: what messages call each rank beside
/// its own (a subgroup's ranks in the default group: "rank 1 (3 in the default group)"). With
/// `let_go` (Python's GPipe), the backend lets go of the store when the last pipeline over it ends
/// (a process group's server then goes when the group is destroyed), and a pipeline made after needs
/// start_over again, with that store or another. While it waits for the other ranks' word on a new
/// store it calls `between` every 100 ms or so, which may throw to stop waiting (Python: Ctrl-C); the
/// others then hear that this rank gave up, as they do when it stops at GPIPE_TIMEOUT.
void start_over(c10::intrusive_ptr<::c10d::Store> store, int rank, int size, const std::string& scope = "",
                const std::vector<int>& known_as = {}, bool let_go = false,
                const std::function<void()>& between = {});

}  // namespace gpipe::c10d
