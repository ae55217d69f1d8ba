#!/usr/bin/env bash
# Configures and builds gpipe: scripts/build.sh [BUILD_DIR] [extra cmake arguments...]
# BUILD_TARGET=gpipe_cli builds only what the target needs (the library and the program).
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir="${1:-build}"
shift || true
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-Release}" "$@" >/dev/null
cmake --build "$build_dir" -j "$(nproc)" ${BUILD_TARGET:+--target "$BUILD_TARGET"}
