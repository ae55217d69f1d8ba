#!/usr/bin/env bash
# Builds gpipe and its tests with AddressSanitizer and UndefinedBehaviorSanitizer in build-asan/
# and runs them (the install test aside). CI runs it after scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh

echo "== build and test (AddressSanitizer + UndefinedBehaviorSanitizer) =="
# libtorch is not instrumented: leaks it keeps until exit are not ours to report.
export ASAN_OPTIONS="detect_leaks=0:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
# -O1 -g1 (line tables): compiles in less time than -O2 -g, and reports still name file and line.
BUILD_TYPE=RelWithDebInfo bash scripts/build.sh build-asan -DGPIPE_SANITIZE=ON -DGPIPE_BUILD_APPS=OFF \
  -DGPIPE_BUILD_EXAMPLES=OFF -DGPIPE_BUILD_BENCH=OFF -DGPIPE_BUILD_PYTHON=OFF -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1"
(cd build-asan && ctest --output-on-failure -j "$(nproc)" -LE install)
