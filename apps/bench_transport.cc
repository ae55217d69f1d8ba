// bench_transport.cc: `gpipe bench --transport`: latency and bandwidth of the MPI transport between two
// ranks, by ping-pong per message size (header and data messages, as a pipeline sends them).
#include "commands.h"
#include "common.h"

#include <gpipe/gpipe.h>
#include <torch/torch.h>

#include <iomanip>
#include <iostream>

namespace gpipe::cli {

int run_transport(int warmup, bool json, const std::string& results, const std::string& command) {
  const std::vector<LinkTiming> timings = or_usage_error("--transport", [&] { return time_link(warmup); });
  if (!job().prints()) return 0;
  if (!json)
    std::cout << std::setw(12) << "bytes" << std::setw(10) << "repeats" << std::setw(16) << "one-way us"
              << std::setw(22) << "(min .. max)" << std::setw(12) << "GB/s" << "\n";
  nlohmann::json rows = nlohmann::json::array();
  for (const LinkTiming& t : timings) {
    const double gb_per_s = static_cast<double>(t.bytes) / t.one_way_s * 1e-9;
    const nlohmann::json row = {{"bytes", t.bytes},          {"repeats", t.repeats},
                                {"one_way_us", t.one_way_s * 1e6}, {"one_way_us_min", t.min_s * 1e6},
                                {"one_way_us_max", t.max_s * 1e6}, {"gb_per_s", gb_per_s}};
    rows.push_back(row);
    if (json) {
      std::cout << row.dump() << std::endl;
      continue;
    }
    std::cout << std::setw(12) << t.bytes << std::setw(10) << t.repeats << std::fixed << std::setprecision(1)
              << std::setw(16) << t.one_way_s * 1e6 << std::setw(22)
              << "(" + fixed(t.min_s * 1e6, 1) + " .. " + fixed(t.max_s * 1e6, 1) + ")" << std::setprecision(3)
              << std::setw(12) << gb_per_s << std::endl;
  }
  write_results(results, rows, command);
  return 0;
}

}  // namespace gpipe::cli
