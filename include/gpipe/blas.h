// blas.h: the BLAS kernel this process runs, the one its CPU deserves, and running with that one.
//
// Debian's libtorch calls the system OpenBLAS, which picks a kernel for the CPU when it loads. On a CPU
// newer than the OpenBLAS, it falls back to a generic kernel without AVX ("Prescott"), several times
// slower than the CPU can go. OpenBLAS reads OPENBLAS_CORETYPE only when it loads, so the fix is an
// environment variable set before the process starts: the gpipe program sets it and starts itself
// again (run_with_best_blas_kernel); a Python or C++ caller gets the line that names it (blas_warning).
#pragma once

#include <string>
#include <vector>

namespace gpipe {

/// The kernel OpenBLAS runs in this process and the one the CPU's features allow.
struct BlasKernel {
  std::string running;    ///< openblas_get_corename(): "Prescott", "Haswell", "SkylakeX"...; "" without OpenBLAS
  std::string best;       ///< the newest kernel of OpenBLAS this CPU's features allow; "" when none is known
  std::string coretype;   ///< OPENBLAS_CORETYPE as this process has it; "" when unset
  std::string vector_isa; ///< the CPU's widest vector instructions: "AVX-512", "AVX2", "AVX" or ""
  /// Who chose `running`: "OpenBLAS" (by the CPU), "OPENBLAS_CORETYPE" (set before the process started),
  /// "gpipe" (run_with_best_blas_kernel started the process again with it) or "GPIPE_BLAS_CORETYPE"
  /// (it did, with the kernel that variable names).
  std::string chosen_by;

  /// OpenBLAS runs one of its kernels without AVX on a CPU with AVX2 or AVX-512.
  bool generic() const;
  /// "" when the kernel is right for the CPU; otherwise a warning that names the variable to export.
  std::string advice() const;
};

/// This process's kernel: OpenBLAS's own name for it, and the CPU's flags from /proc/cpuinfo.
BlasKernel blas_kernel();

/// OpenBLAS's kernels by the names OPENBLAS_CORETYPE takes (x86-64).
const std::vector<std::string>& blas_kernel_names();

/// The newest OpenBLAS kernel for a CPU with `cpu_flags` as /proc/cpuinfo writes them ("avx2", "fma",
/// "avx512f", "avx512_bf16", ...): "Cooperlake", "SkylakeX", "Haswell", "Sandybridge", or "" below AVX.
std::string best_blas_kernel(const std::vector<std::string>& cpu_flags);

/// Whether `kernel` is one of OpenBLAS's x86 kernels without AVX (Prescott, Core2, Nehalem, Barcelona...).
bool blas_kernel_without_avx(const std::string& kernel);

/// GFLOP/s of a float32 product of two 512 x 512 matrices on one BLAS thread, the median of 5 after one;
/// 0 without OpenBLAS. It sets OpenBLAS's process-wide thread count to 1 while it runs: not during a run.
double blas_gflops();

/// Whether this process's float32 and float64 matrix products agree with a plain loop (to 1e-4 and
/// 1e-10 relative): an OpenBLAS kernel chosen for a CPU it does not know may compute wrong results.
bool blas_products_right();

/// The program's kernel, as GPIPE_BLAS_CORETYPE asks: unset, empty or `auto`, the best kernel where
/// OpenBLAS fell back to a generic one and OPENBLAS_CORETYPE is unset (BlasKernel::generic); `keep`,
/// OpenBLAS's own choice; a kernel's name (blas_kernel_names), that kernel. OpenBLAS reads its variable
/// only as it loads, so where the kernel must change this sets OPENBLAS_CORETYPE and executes
/// /proc/self/exe again with `argv` (the same process id: mpirun and torchrun see nothing). Call it
/// first in main(), before anything else runs. In the process started again it checks that OpenBLAS
/// took the kernel and computes right with it (blas_products_right; if not, it starts once more as
/// OpenBLAS chose), and returns the one line to show; otherwise "". Throws std::invalid_argument for a
/// GPIPE_BLAS_CORETYPE that is none of these. The program starts at most twice more (each start loads
/// libtorch again), and only where the kernel changes. Linux only (/proc/self/exe and /proc/cpuinfo): elsewhere
/// `auto` changes nothing, and a kernel named is refused with a std::runtime_error.
std::string run_with_best_blas_kernel(char** argv);

/// Sets the number of OpenBLAS threads, when OpenBLAS is the BLAS of this
/// process. OpenBLAS' pthread build has one process-wide pool: gpipe sets it to
/// the largest thread count among CPU stages, so two stages with one core each
/// do not fight over cores. Returns false when OpenBLAS is not loaded.
bool set_blas_threads(int threads);

/// A short description of the BLAS in use, e.g. "OpenBLAS 0.3.21 ... MAX_THREADS=64".
std::string blas_info();

/// For a process that cannot start again (Python, where torch has loaded OpenBLAS first; a C++
/// program of one's own): BlasKernel::advice, or "" under GPIPE_BLAS_CORETYPE=keep or with
/// OPENBLAS_CORETYPE set. Throws std::invalid_argument for a GPIPE_BLAS_CORETYPE gpipe does not take.
std::string blas_warning();

}  // namespace gpipe
