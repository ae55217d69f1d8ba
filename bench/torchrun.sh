#!/usr/bin/env bash
# bench/torchrun.sh: the c10d transport under torchrun (shared memory between two ranks of this
# machine), then gpipe train's main job (Fashion-MNIST, 8,192 training samples, one epoch) with 2
# ranks under torchrun and under mpirun, alternated ROUNDS times; prints each round's samples/s and the median of the per-round ratios, and
# writes bench/results/c10d-transport.json and bench/results/torchrun-vs-mpirun.json. Each torchrun
# rank binds itself to its share of the cores (GPIPE_BIND_CORES=1), as mpirun binds its ranks.
# Usage: bench/torchrun.sh [PATH/TO/gpipe] [ROUNDS]   (default build/apps/gpipe, 3)
set -euo pipefail
cd "$(dirname "$0")/.."
gpipe="${1:-build/apps/gpipe}"
rounds="${2:-3}"
mpi=(mpirun --oversubscribe -np 2)
[ "$(id -u)" -ne 0 ] || mpi+=(--allow-run-as-root)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "== c10d transport, ranks 0 and 1 on this machine (torchrun)"
bash tests/torchrun.sh 2 "$gpipe" bench --transport --results bench/results/c10d-transport.json 2>/dev/null
run=(train --epochs 1 --train-samples 8192 --test-samples 512)
for r in $(seq "$rounds"); do
  GPIPE_BIND_CORES=1 bash tests/torchrun.sh 2 "$gpipe" "${run[@]}" > "$work/torchrun-$r.txt" 2>/dev/null
  "${mpi[@]}" "$gpipe" "${run[@]}" > "$work/mpirun-$r.txt" 2>/dev/null
done
/usr/bin/python3 - "$work" "$rounds" "$*" <<'PY'
import json, re, statistics, subprocess, sys, datetime
work, rounds = sys.argv[1], int(sys.argv[2])
def rate(path):
    text = open(path).read()
    return float(re.search(r"throughput\s+([0-9.]+) samples/s", text).group(1)), \
           float(re.search(r"bubble\s+([0-9.]+)%", text).group(1)) / 100
rows = []
for r in range(1, rounds + 1):
    (t, tb), (m, mb) = rate(f"{work}/torchrun-{r}.txt"), rate(f"{work}/mpirun-{r}.txt")
    rows.append({"round": r, "torchrun_samples_per_s": t, "torchrun_bubble": tb, "mpirun_samples_per_s": m,
                 "mpirun_bubble": mb, "ratio": t / m})
    print(f"round {r}: torchrun {t:.0f} samples/s (bubble {tb:.2f}), mpirun {m:.0f} (bubble {mb:.2f}): {t / m:.3f}")
median = statistics.median(row["ratio"] for row in rows)
print(f"torchrun / mpirun, median of {rounds} rounds: {median:.3f}")
json.dump({"command": "bench/torchrun.sh " + sys.argv[3],
           "date": datetime.datetime.utcnow().strftime("%Y-%m-%dT%H:%M:%SZ"),
           "workload": "gpipe train, Fashion-MNIST CNN, 8192 training samples, 1 epoch, 2 ranks "
                       "(torchrun's bound to their cores: GPIPE_BIND_CORES=1)",
           "rounds": rows, "median_ratio": median}, open("bench/results/torchrun-vs-mpirun.json", "w"), indent=2)
print("results written to bench/results/torchrun-vs-mpirun.json")
PY
