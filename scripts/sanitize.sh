#!/usr/bin/env bash
# Builds gpipe, its tests and its fuzz targets with Clang, AddressSanitizer and
# UndefinedBehaviorSanitizer in build-asan/, runs the tests (the install test aside; the fuzz
# targets over their seed corpora and past findings), then fuzzes each parser for a short while
# (FUZZ_SECONDS, default 20; scripts/fuzz.sh). CI runs it after scripts/test.sh.
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
# -O1 -g1 (line tables): compiles in less time than -O2 -g, and reports still name file and line.
CC=clang CXX=clang++ BUILD_TYPE=RelWithDebInfo bash scripts/build.sh build-asan -DGPIPE_SANITIZE=ON -DGPIPE_FUZZ=ON -DGPIPE_BUILD_APPS=OFF \
  -DGPIPE_BUILD_EXAMPLES=OFF -DGPIPE_BUILD_BENCH=OFF -DGPIPE_BUILD_PYTHON=OFF -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1"
(cd build-asan && ctest --output-on-failure -j "$(nproc)" -LE install)

echo "== fuzz each parser for ${FUZZ_SECONDS:-20} s =="
FUZZ_SEED="${FUZZ_SEED:-1}" bash scripts/fuzz.sh "${FUZZ_SECONDS:-20}"
