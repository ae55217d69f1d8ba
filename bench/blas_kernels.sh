#!/usr/bin/env bash
# blas_kernels.sh: what OpenBLAS's kernel is worth on this machine: `gpipe bench --workload mlp --stages 1`
# and gpipe machine's GFLOP/s of one thread, with each kernel this CPU can run, alternated in rounds
# (OPENBLAS_CORETYPE set, GPIPE_BLAS_CORETYPE=keep), for docs/benchmarks.md ("The BLAS kernel").
#
# Usage: bench/blas_kernels.sh [ROUNDS] [KERNEL...]   (defaults 3, and Prescott, Haswell, SkylakeX, Cooperlake)
#   RESULTS=FILE writes the results there instead of bench/results/blas-kernels.json
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-3}"
shift || true
kernels=("$@")
[ ${#kernels[@]} -gt 0 ] || kernels=(Prescott Haswell SkylakeX Cooperlake)
gpipe=build/apps/gpipe
out="${RESULTS:-bench/results/blas-kernels.json}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for round in $(seq 1 "$rounds"); do
  for kernel in "${kernels[@]}"; do
    echo "round $round/$rounds: $kernel" >&2
    export OPENBLAS_CORETYPE=$kernel GPIPE_BLAS_CORETYPE=keep
    "$gpipe" bench --workload mlp --stages 1 --micro-batches 1 --checkpoint never --steps 7 \
      --results "$work/mlp-$kernel-$round.json" >/dev/null 2>&1
    "$gpipe" machine --json >"$work/machine-$kernel-$round.json"
  done
done
/usr/bin/python3 - "$work" "$rounds" "$out" "${kernels[@]}" <<'PY'
import datetime, json, statistics, sys
work, rounds, out, kernels = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
rows, machine = [], None
for kernel in kernels:
    mlp = [json.load(open(f"{work}/mlp-{kernel}-{r}.json"))["results"][0]["samples_per_s"] for r in range(1, rounds + 1)]
    machines = [json.load(open(f"{work}/machine-{kernel}-{r}.json")) for r in range(1, rounds + 1)]
    machine = machine or machines[0]
    gflops = [m["blas_kernel"]["gflops_one_thread"] for m in machines]
    running = machines[0]["blas_kernel"]["running"]
    rows.append({"kernel": kernel, "running": running, "mlp_k1_samples_per_s": mlp,
                 "mlp_k1_median": statistics.median(mlp), "gflops_one_thread": gflops,
                 "gflops_median": statistics.median(gflops)})
best = max(r["mlp_k1_median"] for r in rows)
for r in rows:
    r["of_the_fastest"] = r["mlp_k1_median"] / best
    print(f"{r['kernel']:12} (runs {r['running']:11}) mlp K=1 {r['mlp_k1_median']:7.1f} samples/s "
          f"({r['of_the_fastest']:.2f} of the fastest), {r['gflops_median']:5.1f} GFLOP/s one thread")
m = dict(machine)
m["blas_kernel"] = {k: v for k, v in m["blas_kernel"].items() if k in ("best", "vector_isa")}
doc = {"command": " ".join(["bench/blas_kernels.sh", str(rounds)] + kernels),
       "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "machine": m, "results": rows}
open(out, "w").write(json.dumps(doc, indent=2) + "\n")
print(f"results written to {out}")
PY
