#!/usr/bin/env bash
# Installs what is missing, builds (reusing scripts/run.sh's build), and runs every test.
# CI also runs the suite under the sanitizers afterwards: scripts/sanitize.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh

echo "== build and test (Release) =="
bash scripts/build.sh build -DGPIPE_REQUIRE_PYTHON=ON  # the Python package and its tests, or a configure error
(cd build && ctest --output-on-failure -j "$(nproc)")
