#!/usr/bin/env bash
# The main job: installs what is missing, builds, and trains on Fashion-MNIST through a 2-stage pipeline.
# Arguments are passed to `gpipe train`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
BUILD_TARGET=gpipe_cli bash scripts/build.sh build  # the library and the program, no tests
exec ./build/apps/gpipe train "$@"
