#!/usr/bin/env bash
# gpt_vs_pytorch.sh: gpipe train --model gpt's default job beside the same GPT, batch, Adam and
# cosine learning rate in plain PyTorch on one device with 1 and 2 threads (bench/gpt_pytorch.py),
# for docs/models.md.
#
# Each round trains STEPS steps with every contender in turn, so the per-round ratios compare
# runs taken moments apart on a noisy machine; the median ratio over the rounds is reported with
# its min and max. PyTorch runs with the malloc settings gpipe sets for itself (see
# gpipe::keep_freed_memory), the fair comparison, as bench/train_vs_pytorch.sh. The fraction of
# the 2-core limit is gpipe's samples/s over twice PyTorch's on one thread, per round.
#
# Usage: [GPIPE=path/to/gpipe] [STEPS=30] bench/gpt_vs_pytorch.sh [ROUNDS] [-- extra gpipe flags, quoted as one]
#   e.g. bench/gpt_vs_pytorch.sh 5 -- "--micro-batches 8"
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-5}"
shift || true
[ "${1:-}" != "--" ] || shift
extra="${1:-}"
gpipe="${GPIPE:-build/apps/gpipe}"
python=/usr/bin/python3
# The same BLAS kernel for gpipe and PyTorch: the one gpipe runs with (gpipe machine --kernel; a generic
# kernel on a CPU newer than OpenBLAS is replaced), unless OPENBLAS_CORETYPE is set already.
kernel="${OPENBLAS_CORETYPE:-$("$gpipe" machine --kernel)}"
export OPENBLAS_CORETYPE="$kernel"
steps="${STEPS:-30}"
out=bench/results/gpt-vs-pytorch.json
kept=(MALLOC_TRIM_THRESHOLD_=268435456 MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TOP_PAD_=67108864)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for round in $(seq 1 "$rounds"); do
  echo "round $round/$rounds" >&2
  # shellcheck disable=SC2086
  "$gpipe" train --model gpt --steps "$steps" --test-samples 16 --json $extra >"$work/gpipe-$round.json" 2>/dev/null
  for threads in 1 2; do
    env "${kept[@]}" "$python" bench/gpt_pytorch.py --threads "$threads" --steps "$steps" \
      >"$work/pytorch-$threads-$round.json" 2>/dev/null
  done
done

"$python" - "$work" "$rounds" "$out" "$steps" "$extra" <<'PY'
import datetime, json, os, statistics, sys
work, rounds, out, steps, extra = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
load = lambda name: [json.load(open(f"{work}/{name}-{r}.json")) for r in range(1, rounds + 1)]
rate = lambda runs: [run["samples_per_s"] for run in runs]
gpipe, one, two = load("gpipe"), load("pytorch-1"), load("pytorch-2")
g, p1, p2 = rate(gpipe), rate(one), rate(two)
def spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "per_round": values}
rows = {
    "gpipe samples_per_s": spread(g),
    "pytorch 1 thread samples_per_s": spread(p1),
    "pytorch 2 threads samples_per_s": spread(p2),
    "gpipe / pytorch 1 thread": spread([a / b for a, b in zip(g, p1)]),
    "gpipe / pytorch 2 threads": spread([a / b for a, b in zip(g, p2)]),
    "fraction of the 2-core limit": spread([a / (2 * b) for a, b in zip(g, p1)]),
}
first = gpipe[0]
for label, row in rows.items():
    print(f"{label:32s} {row['median']:9.3f}  ({row['min']:.3f} .. {row['max']:.3f})")
doc = {"command": "bash bench/gpt_vs_pytorch.sh " + str(rounds) + (f' -- "{extra}"' if extra else ""),
       "date": datetime.datetime.utcnow().strftime("%Y-%m-%dT%H:%M:%SZ"), "rounds": rounds,
       "steps_per_round": steps, "batch_size": first["batch_size"], "context": first["context"],
       "gpipe": {k: first[k] for k in ("stages", "balance", "schedule", "micro_batches", "checkpoint", "optimizer",
                                       "lr", "lr_schedule", "machine")},
       "gpipe_bubble": statistics.median(run["bubble"] for run in gpipe),
       "results": rows}
with open(out + ".tmp", "w") as f:
    json.dump(doc, f, indent=2)
os.replace(out + ".tmp", out)
print(f"results written to {out}", file=sys.stderr)
PY
