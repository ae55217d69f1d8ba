#!/usr/bin/env bash
# Installs what is missing, builds (reusing scripts/run.sh's build), and runs every test.
# CI also runs the suite under the sanitizers afterwards: scripts/sanitize.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh

echo "== build and test (Release) =="
# What the tests run (gpipe_test_programs: the library, the program, the Python package, the test
# programs, bench/largest_model and the training example), not the other examples and benchmarks,
# which no test runs; the Python package and its tests, or a configure error.
BUILD_TARGET=gpipe_test_programs bash scripts/build.sh build -DGPIPE_REQUIRE_PYTHON=ON
(cd build && ctest --output-on-failure -j "$(nproc)")
