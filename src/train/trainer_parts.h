// trainer_parts.h: what the trainer's files (trainer.cc, trainer_steps.cc, trainer_files.cc,
// model_checks.cc) share and no user of the library sees: the random generators' state, a piece of
// work whose success every rank learns, and a check run on a model's first rows.
#pragma once

#include "gpipe/check.h"
#include "gpipe/pipeline.h"

#include <torch/torch.h>

#include <algorithm>
#include <exception>
#include <functional>
#include <string>

namespace gpipe::detail {

/// The state of `generator` (a copy: the generator draws on).
inline torch::Tensor generator_state(const at::Generator& generator) {
  at::Generator g = generator;
  return g.get_state();
}

/// The CPU generator torch's random functions draw from.
inline at::Generator default_generator() { return at::globalContext().defaultGenerator(torch::kCPU); }

/// Runs `work` on this rank, then every rank learns whether every other's succeeded (a collective
/// that all of them reach): this rank rethrows its own error as Error; the others throw Error
/// naming the highest failed rank and `what_it_did` ("refused the run").
template <class Error>
void on_all_ranks(Pipeline& pipeline, const std::function<void()>& work, const std::string& what_it_did) {
  std::string error;
  try {
    work();
  } catch (const std::exception& e) {
    error = what_of(e);
    if (error.rfind("gpipe: ", 0) != 0) error = "gpipe: " + error;  // as every error of the library begins
  }
  const double failed = pipeline.max(error.empty() ? -1.0 : static_cast<double>(pipeline.rank()));
  if (!error.empty()) throw Error(error);
  if (failed >= 0)
    throw Error("gpipe: rank " + std::to_string(static_cast<int>(failed)) + " " + what_it_did +
                " (its message says why)");
}

/// fn on the first two rows of `input`, or, where it fails on two, on up to 64: a layer may need more
/// rows than two (a view by 4, a statistic over the batch), which its micro-batches will have. Where
/// it fails on both, what it said on two.
template <typename Fn>
auto on_the_first_rows(const torch::Tensor& input, Fn&& fn) {
  try {
    return fn(input.narrow(0, 0, std::min<int64_t>(2, input.size(0))));
  } catch (const std::exception&) {
    if (input.size(0) <= 2) throw;
    const std::exception_ptr on_two = std::current_exception();
    try {
      return fn(input.narrow(0, 0, std::min<int64_t>(64, input.size(0))));
    } catch (const std::exception&) {
      std::rethrow_exception(on_two);
    }
  }
}

}  // namespace gpipe::detail
