#!/usr/bin/env bash
# train_vs_pytorch.sh: gpipe train's default job beside the same CNN, batch and Adam in plain
# PyTorch on one device with 1 and 2 threads (bench/pytorch_train.py), for docs/benchmarks.md.
#
# Each round trains one epoch of TRAIN_SAMPLES samples with every contender in turn, so the
# per-round ratios compare runs taken moments apart on a noisy machine; the median ratio over
# the rounds is reported with its min and max. PyTorch runs twice per thread count: with the C
# library's default malloc settings, and with the ones gpipe sets for itself (see
# gpipe::keep_freed_memory), which are the fair comparison.
#
# Usage: bench/train_vs_pytorch.sh [ROUNDS] [-- extra gpipe configurations, each one quoted]
#   e.g. bench/train_vs_pytorch.sh 5 -- "--schedule gpipe --micro-batches 4" "--micro-batches 8"
#   RESULTS=FILE writes the results there instead of bench/results/train-vs-pytorch.json
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-5}"
shift || true
[ "${1:-}" != "--" ] || shift
gpipe=build/apps/gpipe
python=/usr/bin/python3
# The same BLAS kernel for gpipe and PyTorch: the one gpipe runs with (gpipe machine --kernel; a generic
# kernel on a CPU newer than OpenBLAS is replaced), unless OPENBLAS_CORETYPE is set already.
kernel="${OPENBLAS_CORETYPE:-$("$gpipe" machine --kernel)}"
export OPENBLAS_CORETYPE="$kernel"
samples="${TRAIN_SAMPLES:-12800}"
out="${RESULTS:-bench/results/train-vs-pytorch.json}"  # RESULTS=FILE: write elsewhere
kept=(MALLOC_TRIM_THRESHOLD_=268435456 MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TOP_PAD_=67108864)

configs=("" "$@")  # "" is the default job
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for round in $(seq 1 "$rounds"); do
  echo "round $round/$rounds" >&2
  for n in "${!configs[@]}"; do
    # shellcheck disable=SC2086
    "$gpipe" train --train-samples "$samples" --test-samples 1000 --epochs 1 --json ${configs[$n]} \
      >"$work/gpipe-$n-$round.json" 2>/dev/null
  done
  for threads in 2 1; do
    env "${kept[@]}" "$python" bench/pytorch_train.py --threads "$threads" --train-samples "$samples" \
      >"$work/pytorch-kept-$threads-$round.json" 2>/dev/null
    "$python" bench/pytorch_train.py --threads "$threads" --train-samples "$samples" \
      >"$work/pytorch-default-$threads-$round.json" 2>/dev/null
  done
done

"$python" - "$work" "$rounds" "$out" "$(printf '%s\n' "${configs[@]}")" <<'PY'
import datetime, json, os, statistics, sys
work, rounds, out, configs = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4].split("\n")
load = lambda name: [json.load(open(f"{work}/{name}-{r}.json")) for r in range(1, rounds + 1)]
rate = lambda runs: [run["samples_per_s"] for run in runs]
baselines = {f"pytorch {threads} thread{'s' if threads == 2 else ''}, {how} malloc": load(f"pytorch-{how}-{threads}")
             for how in ("kept", "default") for threads in (2, 1)}
reference = rate(baselines["pytorch 2 threads, kept malloc"])
# The 2-core limit: two devices each as fast as plain PyTorch on one thread (same malloc settings).
one_thread = rate(baselines["pytorch 1 thread, kept malloc"])
rows = []
def summary(label, runs, extra=None):
    r = rate(runs)
    ratios = [a / b for a, b in zip(r, reference)]
    row = {"contender": label, "samples_per_s": statistics.median(r), "samples_per_s_min": min(r),
           "samples_per_s_max": max(r), "vs_pytorch_2_threads": statistics.median(ratios),
           "vs_pytorch_2_threads_min": min(ratios), "vs_pytorch_2_threads_max": max(ratios),
           "per_round": r}
    row.update(extra or {})
    rows.append(row)
    print(f"{label:58s} {row['samples_per_s']:8.0f} samples/s  x{row['vs_pytorch_2_threads']:.3f} "
          f"({row['vs_pytorch_2_threads_min']:.3f} .. {row['vs_pytorch_2_threads_max']:.3f}) vs PyTorch 2 threads")
for n, config in enumerate(configs):
    runs = load(f"gpipe-{n}")
    first = runs[0]
    label = "gpipe train " + (config or "(defaults)")
    of_limit = [g / (2 * p) for g, p in zip(rate(runs), one_thread)]
    summary(label, runs, {"schedule": first["schedule"], "virtual_stages": first["virtual_stages"],
                          "micro_batches": first["micro_batches"], "balance": first["balance"],
                          "bubble": statistics.median(run["bubble"] for run in runs), "machine": first["machine"],
                          "of_2_core_limit": statistics.median(of_limit), "of_2_core_limit_min": min(of_limit),
                          "of_2_core_limit_max": max(of_limit)})
    print(f"{'':58s} {statistics.median(of_limit):.3f} ({min(of_limit):.3f} .. {max(of_limit):.3f}) of the 2-core "
          f"limit (2 x PyTorch 1 thread, kept malloc)")
for label, runs in baselines.items():
    summary(label, runs)
doc = {"command": "bash bench/train_vs_pytorch.sh " + str(rounds) + "".join(f' "{c}"' for c in configs if c),
       "date": datetime.datetime.utcnow().strftime("%Y-%m-%dT%H:%M:%SZ"),
       "train_samples_per_round": load("pytorch-kept-2")[0]["samples"], "rounds": rounds, "results": rows}
with open(out + ".tmp", "w") as f:
    json.dump(doc, f, indent=2)
os.replace(out + ".tmp", out)
print(f"results written to {out}", file=sys.stderr)
PY
