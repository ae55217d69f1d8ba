// machine.cc: `gpipe machine`: what gpipe runs on, as it sees it: the CPU, the BLAS and the kernel
// OpenBLAS runs (the one this CPU deserves, and who chose it), and what one thread's products reach.
#include "commands.h"
#include "common.h"

#include <gpipe/blas.h>
#include <gpipe/environment.h>
#include <gpipe/results.h>

#include <iostream>
#include <memory>

namespace gpipe::cli {
namespace {

struct MachineOptions {
  bool kernel = false;
  bool json = false;
};

int run(const MachineOptions& o) {
  const BlasKernel kernel = blas_kernel();
  if (o.kernel) {
    if (kernel.running.empty()) {
      std::cerr << "gpipe machine: the BLAS of this process is not OpenBLAS (" << blas_info() << "): no kernel\n";
      return 1;
    }
    std::cout << kernel.running << "\n";
    return 0;
  }
  const nlohmann::json m = machine();
  if (o.json) {
    std::cout << m.dump(2) << "\n";
    return 0;
  }
  const nlohmann::json& k = m["blas_kernel"];
  std::cout << "cpu      " << m["cpu"].get<std::string>() << ", " << m["cores"] << " cores"
            << (kernel.vector_isa.empty() ? "" : ", " + kernel.vector_isa) << "\n"
            << "blas     " << m["blas"].get<std::string>() << "\n";
  if (kernel.running.empty()) return 0;
  std::cout << "kernel   " << kernel.running << ", chosen by " << kernel.chosen_by
            << (kernel.coretype.empty() || kernel.chosen_by == "gpipe" ? "" : "=" + kernel.coretype)
            << "; the best for this CPU: " << (kernel.best.empty() ? "none known" : kernel.best) << "\n"
            << "speed    " << fixed(k["gflops_one_thread"].get<double>(), 1)
            << " GFLOP/s on one thread (float32, 512 x 512 product)\n";
  if (const std::string advice = kernel.advice(); !advice.empty() && environment_value("GPIPE_BLAS_CORETYPE") != "keep")
    std::cout << advice << "\n";
  return 0;
}

}  // namespace

void add_machine_command(CLI::App& app, const std::string& /*command*/, int& status) {
  auto o = std::make_shared<MachineOptions>();
  CLI::App* sub = app.add_subcommand(
      "machine", "what gpipe runs on: the CPU, the BLAS, the kernel OpenBLAS runs and who chose it, the best "
                 "kernel for this CPU, and the GFLOP/s of one thread");
  sub->add_flag("--kernel", o->kernel,
                "print only the name of the kernel gpipe runs with, to export as OPENBLAS_CORETYPE for a program "
                "compared with gpipe");
  sub->add_flag("--json", o->json, "one JSON object: the machine as result files and --json record it");
  sub->callback([o, &status] { status = run(*o); });
}

}  // namespace gpipe::cli
