#!/usr/bin/env bash
# Installs what is missing, builds (reusing scripts/run.sh's build), and runs every test.
# CI also runs the suite under the sanitizers afterwards: scripts/sanitize.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh

echo "== build and test (Release) =="
# Everything, the examples and benchmarks no test runs included (a change that breaks their build
# fails here; they cost about 40 s of a fresh build); the Python package and its tests, or a
# configure error. BUILD_TARGET=gpipe_test_programs builds only what the tests run.
bash scripts/build.sh build -DGPIPE_REQUIRE_PYTHON=ON
(cd build && ctest --output-on-failure -j "$(nproc)")
