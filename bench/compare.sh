#!/usr/bin/env bash
# compare.sh: gpipe and Python PyTorch on the same workloads, back to back, for docs/benchmarks.md.
# Usage: bench/compare.sh (after scripts/build.sh; needs Debian's python3-torch)
set -euo pipefail
cd "$(dirname "$0")/.."
# The same BLAS kernel for gpipe and PyTorch: the one gpipe runs with (gpipe machine --kernel; a generic
# kernel on a CPU newer than OpenBLAS is replaced), unless OPENBLAS_CORETYPE is set already.
kernel="${OPENBLAS_CORETYPE:-$(./build/apps/gpipe machine --kernel)}"
export OPENBLAS_CORETYPE="$kernel"
args=(--workload mlp transformer --stages 2 --micro-batches 32 --checkpoint except_last)
./build/apps/gpipe bench "${args[@]}" --results bench/results/compare-gpipe.json
/usr/bin/python3 bench/pytorch_compare.py "${args[@]}" --results bench/results/compare-pytorch.json 2> >(grep -v -e '^I20' -e '^WARNING: Logging' >&2)
