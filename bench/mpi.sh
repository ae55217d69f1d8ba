#!/usr/bin/env bash
# bench/mpi.sh: the MPI transport on loopback (latency and bandwidth per message size), then
# `mlp` at K=2 over MPI (one rank per core) against K=2 in one process, in one run.
# Usage: bench/mpi.sh [PATH/TO/gpipe]   (default build/apps/gpipe)
set -euo pipefail
cd "$(dirname "$0")/.."
gpipe="${1:-build/apps/gpipe}"
flags=(--bind-to core)
[ "$(id -u)" -ne 0 ] || flags+=(--allow-run-as-root)
steps=(--steps 9 --warmup 2)

echo "== MPI transport, ranks 0 and 1 on this machine"
mpirun "${flags[@]}" -np 2 "$gpipe" bench --transport --results bench/results/mpi-transport.json
echo "== mlp, K=2, M=32: one rank per stage over MPI"
mpirun "${flags[@]}" -np 2 "$gpipe" bench --workload mlp --stages 2 --micro-batches 32 "${steps[@]}" \
  --results bench/results/mpi-mlp-k2.json
echo "== mlp, K=2, M=32: both stages in one process"
"$gpipe" bench --workload mlp --stages 2 --micro-batches 32 "${steps[@]}" --results bench/results/inprocess-mlp-k2.json
/usr/bin/python3 - <<'PY'
import json
mpi = json.load(open("bench/results/mpi-mlp-k2.json"))["results"][0]
one = json.load(open("bench/results/inprocess-mlp-k2.json"))["results"][0]
ratio = mpi["samples_per_s"] / one["samples_per_s"]
print(f"mlp K=2 M=32: MPI {mpi['samples_per_s']:.1f} samples/s (bubble {mpi['bubble']:.3f}), "
      f"one process {one['samples_per_s']:.1f} (bubble {one['bubble']:.3f}): MPI/one process = {ratio:.3f}")
PY
