// bench_transport.cc: `gpipe bench --transport`: latency and bandwidth of the MPI transport between two
// ranks, by ping-pong per message size (header and data messages, as a pipeline sends them).
#include "commands.h"
#include "common.h"
#include "world.h"

#include <gpipe/gpipe.h>
#include <torch/torch.h>

#include <iomanip>
#include <iostream>

namespace gpipe::cli {

int run_transport(int warmup, bool json, const std::string& results, const std::string& command) {
#if defined(GPIPE_HAS_MPI) && GPIPE_HAS_MPI
  const World& w = world();
  GPIPE_CHECK(w.mpi && w.size == 2, "--transport measures the link between two ranks; start it with mpirun -np 2 "
              "(got ", w.size, w.size == 1 ? " rank)" : " ranks)");
  mpi::ErrorChannel errors(MPI_COMM_WORLD);
  mpi::MpiTransport transport(MPI_COMM_WORLD, &errors, {0, 1}, 1);  // stage r on rank r
  const int peer = 1 - w.rank;
  nlohmann::json rows = nlohmann::json::array();
  if (w.prints() && !json)
    std::cout << std::setw(12) << "bytes" << std::setw(10) << "repeats" << std::setw(16) << "one-way us"
              << std::setw(22) << "(min .. max)" << std::setw(12) << "GB/s" << "\n";
  for (int64_t bytes = 8; bytes <= (int64_t{64} << 20); bytes *= 8) {
    const torch::Tensor message = torch::ones({bytes / 4});
    const int repeats = static_cast<int>(std::clamp<int64_t>((int64_t{256} << 20) / bytes, 10, 2000));
    std::vector<double> one_way_s;
    for (int r = 0; r < warmup + repeats; ++r) {
      const int64_t begin = now_ns();
      if (w.rank == 0) {
        transport.send(0, peer, Channel::kActivation, 0, message);
        transport.recv(peer, 0, Channel::kGradient, 0);
      } else {
        transport.recv(peer, 1, Channel::kActivation, 0);
        transport.send(1, peer, Channel::kGradient, 0, message);
      }
      transport.finish();
      if (r >= warmup) one_way_s.push_back(static_cast<double>(now_ns() - begin) * 0.5e-9);
    }
    if (!w.prints()) continue;
    const double t = median(one_way_s);
    const auto [lo, hi] = std::minmax_element(one_way_s.begin(), one_way_s.end());
    const nlohmann::json row = {{"bytes", bytes},           {"repeats", repeats},
                                {"one_way_us", t * 1e6},    {"one_way_us_min", *lo * 1e6},
                                {"one_way_us_max", *hi * 1e6}, {"gb_per_s", static_cast<double>(bytes) / t * 1e-9}};
    rows.push_back(row);
    if (json) {
      std::cout << row.dump() << std::endl;
      continue;
    }
    std::cout << std::setw(12) << bytes << std::setw(10) << repeats << std::fixed << std::setprecision(1)
              << std::setw(16) << t * 1e6 << std::setw(22)
              << "(" + fixed(*lo * 1e6, 1) + " .. " + fixed(*hi * 1e6, 1) + ")"
              << std::setprecision(3) << std::setw(12) << static_cast<double>(bytes) / t * 1e-9 << std::endl;
  }
  if (w.prints()) write_results(results, rows, command);
  return 0;
#else
  (void)warmup, (void)json, (void)results, (void)command;
  GPIPE_CHECK(false, "--transport times MPI messages: build with MPI and start it with mpirun -np 2");
  return 1;
#endif
}

}  // namespace gpipe::cli
