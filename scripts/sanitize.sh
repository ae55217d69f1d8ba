#!/usr/bin/env bash
# Builds gpipe with Clang, AddressSanitizer and UndefinedBehaviorSanitizer in build-asan/, with the
# tests of the core paths and the fuzz targets, runs them (the fuzz targets over their seed corpora
# and past findings), then fuzzes each parser for a short while (FUZZ_SECONDS, default 10;
# scripts/fuzz.sh). CI runs it after scripts/test.sh, which runs every test without the sanitizers.
# The tests here (SANITIZED_TESTS, a space-separated list, replaces them): the pipeline and its
# schedules, failures and faults, the training loop with save and resume, file I/O, and the MPI and
# c10d transports (mpi_test at np 2, c10d_test at np 2 under torchrun). Left out, for time (each a
# compile of a minute or more under the sanitizers, and CI has 30 minutes for everything): the tests
# that run these same paths over more models and configurations (micro-batches, partitioning and
# plans, the in-process transport, re-materialization, the I/W split, skips, tied weights,
# transparency, BatchNorm, the model zoo, memory, the cost model and planner, tasks, make_pipeline,
# tuples, CUDA); name them in SANITIZED_TESTS to run them too.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh clang libclang-rt-14-dev  # libFuzzer

echo "== build and test (AddressSanitizer + UndefinedBehaviorSanitizer) =="
# libtorch is not instrumented: leaks it keeps until exit are not ours to report.
export ASAN_OPTIONS="detect_leaks=0:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
# A build-asan/ configured with another compiler (an older sanitize.sh used g++) starts anew.
if [ -f build-asan/CMakeCache.txt ] && ! grep -q '^CMAKE_CXX_COMPILER:.*clang' build-asan/CMakeCache.txt; then
  rm -rf build-asan
fi
# shellcheck disable=SC2206  # SANITIZED_TESTS: a list, split at its spaces
tests=(${SANITIZED_TESTS:-pipeline_test schedule_test fault_test io_test train_test mpi_test c10d_test})
fuzzers=(fuzz_schedule_text fuzz_byte_size fuzz_checkpoint fuzz_idx fuzz_torch_save fuzz_flags)
# The tests and fuzz targets as one target, gpipe_together (CMakeLists.txt), so that make spreads
# them over the cores. -O1 -g1 (line tables): compiles in less time than -O2 -g, and reports still
# name file and line.
together=$(printf '%s;' "${tests[@]}" "${fuzzers[@]}")
CC=clang CXX=clang++ BUILD_TYPE=RelWithDebInfo BUILD_TARGET=gpipe_together bash scripts/build.sh build-asan \
  -DGPIPE_SANITIZE=ON -DGPIPE_FUZZ=ON -DGPIPE_BUILD_APPS=OFF -DGPIPE_BUILD_EXAMPLES=OFF -DGPIPE_BUILD_BENCH=OFF \
  -DGPIPE_BUILD_PYTHON=OFF -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DGPIPE_BUILD_TOGETHER="${together%;}"
targets=("${fuzzers[@]}")
for t in "${tests[@]}"; do
  # mpi_test where MPI is built, c10d_test where c10d is
  case "$t" in
    mpi_test|c10d_test) grep -q "${t}_np2" build-asan/tests/CTestTestfile.cmake && targets+=("$t") ;;
    *) targets+=("$t") ;;
  esac
done
# Each test built, mpi_test and c10d_test at np 2 (more ranks run more sanitized processes on this
# machine's cores), and the fuzz targets over their inputs.
names=$(printf '%s|' "${targets[@]}" | sed 's/|$//; s/mpi_test/mpi_test_np2/; s/c10d_test/c10d_test_np2/')
(cd build-asan && ctest --output-on-failure -j "$(nproc)" -R "^(${names})\$")

echo "== fuzz each parser for ${FUZZ_SECONDS:-10} s =="
FUZZ_SEED="${FUZZ_SEED:-1}" bash scripts/fuzz.sh "${FUZZ_SECONDS:-10}"
