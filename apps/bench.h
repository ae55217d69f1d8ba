// bench.h: what the parts of `gpipe bench` share: its flags' values, one configuration of a
// comparison, and the rows it reports (bench_rows.cc).
#pragma once

#include <gpipe/gpipe.h>

#include <nlohmann/json.hpp>

#include <memory>
#include <string>
#include <vector>

namespace gpipe::cli {

struct BenchOptions {
  std::vector<std::string> workloads{"mlp"};
  std::vector<int> stages{2};
  std::vector<int> micro_batches{32};
  std::vector<std::string> checkpoints{"except_last"};
  std::vector<std::string> schedules{"gpipe"};
  int virtual_stages = 0;  // 0: each schedule's own (2 for interleaved, zbv and v-half)
  int threads = 1;
  int steps = 7;
  int warmup = 2;
  std::vector<std::string> balance_by{"even"};
  std::vector<int> balance;  // an explicit cut, for the one K it fits
  bool balance_by_given = false;
  bool json = false;
  bool tie_embeddings = false;  // the transformer's output layer reads its embedding's weight
  bool transport = false;       // MPI: time the transport alone (bench_transport.cc)
  std::string results = "bench/results/bench.json";
};

// One configuration of a comparison: the whole batch on one device (unsplit), or a pipeline. Every
// configuration of a comparison runs one step in turn, so each ratio compares steps taken moments
// apart on the same noisy machine.
struct Contender {
  int devices = 1;  // K
  std::string task;  // its name
  std::string schedule = "gpipe";
  int virtual_stages = 1;
  std::string balance_by = "even";
  bool unsplit = false;  // the whole batch in one piece on the calling thread
  Dataset batch;         // the task's batch
  torch::nn::Sequential whole;  // unsplit: the whole model
  std::unique_ptr<Pipeline> pipe;
  std::unique_ptr<torch::optim::Optimizer> sgd;
  Prediction predicted;  // the cost model's figures (cost_model.h)
  // Per timed step:
  std::vector<double> step_s, bubbles, overhead_s, simulated_s, sent_bytes;
  std::vector<int64_t> peak_bytes, held_bytes, parameter_bytes;  // per device held here, largest over the steps
};

/// The row of contender `c` against the baselines (none under MPI) and the first schedule asked for
/// at the same K and cut (`first`, or null).
nlohmann::json row_of(const Contender& c, const Contender* unsplit, const Contender* one, const Contender* first,
                      const std::string& name, int M, Checkpoint mode, const BenchOptions& o);
void print_header();
void print_row(const nlohmann::json& row);

}  // namespace gpipe::cli
