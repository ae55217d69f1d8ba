// job.h (internal): what job.h's functions need of MPI.
#pragma once

#include "gpipe/job.h"

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace gpipe::mpi {

/// Starts MPI for the rest of the process; returns this rank and the ranks.
std::pair<int, int> start_job(int* argc, char*** argv);
/// Ends the whole job with `status` after `print`ing `message` as job.h's end_job says.
[[noreturn]] void end_job(int status, const std::string& message, const std::function<void(const std::string&)>& print,
                          int rank);

/// job.h's time_link, on this `rank` of a job of two.
std::vector<LinkTiming> time_link(int warmup, int rank);

}  // namespace gpipe::mpi
