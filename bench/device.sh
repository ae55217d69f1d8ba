#!/usr/bin/env bash
# bench/device.sh: the one command of the lent GPU machine (issue 31, docs/gpu.md). In one call of
# at most 9 minutes it prints the tools there, configures gpipe against that machine's libtorch
# (python3's torch) without MPI and with the dependencies of third_party/ (scripts/vendor-deps.sh),
# builds what it needs with 16 jobs, runs the CUDA tests, takes the measurements and writes
# bench/results/device.json (and a copy, the log and the trace under $OUT when it is set).
#
# Every phase has its own time limit, and a global deadline caps them all (GPIPE_DEVICE_SECONDS,
# default 530 s); a phase that runs out is stopped and the next one starts; what finished is
# written whatever happens after it.
#
#   bash bench/device.sh                       on the GPU machine
#   GPIPE_DEVICE_SMOKE=1 GPIPE_DEVICE_BUILD=build bash bench/device.sh
#                                              here: tiny sizes, an existing build folder, CUDA
#                                              phases skipped; proves the phases and the JSON
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
smoke=${GPIPE_DEVICE_SMOKE:-0}
deadline=$((SECONDS + ${GPIPE_DEVICE_SECONDS:-530}))
jobs=${GPIPE_DEVICE_JOBS:-16}
build=${GPIPE_DEVICE_BUILD:-build-device}
results=${GPIPE_DEVICE_RESULTS:-bench/results/device.json}
work=$(mktemp -d /tmp/gpipe-device.XXXXXX)
out=${OUT:-}
phases="$work/phases.jsonl"
: >"$phases"

log() { echo "[device.sh +${SECONDS}s] $*"; }

# phase NAME SECONDS COMMAND...: runs COMMAND with the smaller of SECONDS and what the deadline
# leaves (keeping 15 s to write the results), its standard output into $work/NAME.out.
phase() {
  local name=$1 limit=$2
  shift 2
  local left=$((deadline - SECONDS - 15))
  ((left < limit)) && limit=$left
  if ((limit < 5)); then
    log "$name: skipped, the deadline is near"
    echo "{\"phase\": \"$name\", \"status\": \"skipped\", \"seconds\": 0, \"limit\": $limit}" >>"$phases"
    return 1
  fi
  log "$name: up to ${limit}s: $*"
  local begin=$SECONDS status
  timeout --kill-after=5 "$limit" "$@" >"$work/$name.out" 2>"$work/$name.err"
  status=$?
  local spent=$((SECONDS - begin)) what=ok
  ((status == 124 || status == 137)) && what=timeout
  ((status != 0 && status != 124 && status != 137)) && what="failed ($status)"
  echo "{\"phase\": \"$name\", \"status\": \"$what\", \"seconds\": $spent, \"limit\": $limit}" >>"$phases"
  log "$name: $what in ${spent}s"
  tail -n 5 "$work/$name.err" | sed "s/^/  $name stderr: /"
  return $status
}

# The Python with torch: the machine's python3 (the GPU one), else Debian's.
python=""
for p in ${PYTHON:-} python3 /usr/bin/python3; do
  if "$p" -c "import torch" >/dev/null 2>&1; then python=$p; break; fi
done

# 1. What is there.
{
  echo "cores: $(nproc)"
  for tool in cmake ninja nvcc g++ ccache mpirun nvidia-smi; do
    printf '%s: %s\n' "$tool" "$(command -v "$tool" || echo missing)"
  done
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  for header in /usr/include/CLI/CLI.hpp /usr/include/nlohmann/json.hpp /usr/include/gtest/gtest.h /usr/include/zlib.h \
                /usr/include/png.h /usr/include/mpi.h; do
    printf '%s: %s\n' "$header" "$([ -e "$header" ] && echo yes || echo no)"
  done
  echo "third_party: $([ -d third_party/usr ] && echo present || echo 'missing (run scripts/vendor-deps.sh where the packages are)')"
  echo "python with torch: ${python:-none}"
} | tee "$work/tools.txt"
torch_prefix=""
if [ -n "$python" ]; then
  "$python" - >"$work/env.json" <<'PY'
import json, torch
cuda = torch.cuda.is_available()
free, total = torch.cuda.mem_get_info(0) if cuda else (0, 0)
print(json.dumps({"torch": torch.__version__, "torch_cuda": torch.version.cuda,
                  "device": torch.cuda.get_device_name(0) if cuda else "cpu (no CUDA device visible)",
                  "gpu_free_bytes": free, "gpu_total_bytes": total,
                  "cmake_prefix_path": torch.utils.cmake_prefix_path}))
PY
  cat "$work/env.json"
  torch_prefix=$("$python" -c "import json; print(json.load(open('$work/env.json'))['cmake_prefix_path'])")
fi
gpu_free=$("$python" -c "import json; print(json.load(open('$work/env.json'))['gpu_free_bytes'])" 2>/dev/null || echo 0)

# 2. Configure and build: without MPI, against python3's libtorch, only the targets measured here.
if [ "$smoke" = 1 ] && [ -f "$build/CMakeCache.txt" ]; then
  log "configure: smoke mode reuses $build"
else
  generator=()
  command -v ninja >/dev/null && generator=(-G Ninja)
  phase configure 45 cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DGPIPE_MPI=OFF \
    ${torch_prefix:+-DCMAKE_PREFIX_PATH=$torch_prefix} -DGPIPE_THIRD_PARTY="$root/third_party" \
    -DGPIPE_BUILD_PYTHON=OFF -DGPIPE_BUILD_EXAMPLES=OFF -DGPIPE_BUILD_APPS=OFF
  grep -E "gpipe:|Torch|CUDA" "$work/configure.out" | head -n 20
fi
phase build 260 cmake --build "$build" -j "$jobs" --target cuda_test device_bench
tail -n 3 "$work/build.out"

# 3. The CUDA tests (skipped without a GPU): exactness on one GPU, K = 2 and 3.
phase cuda_test 40 env GPIPE_CUDA_RESULT="$work/cuda.json" "$build/tests/cuda_test" --gtest_brief=1
tail -n 4 "$work/cuda_test.out"

# 4. The measurements, each a phase of its own.
bench="$build/bench/device_bench"
if [ "$smoke" = 1 ]; then
  t2=(--layers 4 --width 16 --heads 2 --ffn 32 --sequence 4 --batch 16 --vocab 50 --stages 1,2 --micro-batches 4,1
      --wide-stages 2 --wide-threads 2 --cuts even,time --steps 1 --warmup 1)
  # The GPU phases' logic on CPU devices (--device cpu), Table 1 under a cap of gpipe's tracking allocator.
  g=(--layers 2 --width 32 --heads 2 --ffn 64 --sequence 8 --batch 8 --vocab 50 --stages 1,2 --steps 1 --warmup 1
     --device cpu)
  t1=(--width 32 --heads 2 --ffn 64 --sequence 8 --batch 8 --vocab 50 --steps 1 --cap 4MiB --device cpu)
else
  # Table 2: 32 encoder blocks of width 128 on 16 cores; K = 1, 2, 4, 8 one core each, and K = 8 with 2
  # (K = 1 with 2 too, its base); each K cut evenly and by the layers' profiled time. M = 32 first: the
  # paper's targets are there, if the budget ends early.
  t2=(--layers 32 --width 128 --heads 4 --ffn 512 --sequence 32 --batch 64 --vocab 1000 --stages 1,2,4,8
      --micro-batches 32,4,1 --wide-stages 8 --wide-threads 2 --cuts even,time --steps 1 --warmup 1)
  # The GPU Transformer: width 1024, 24 blocks, sequences of 512, batch 32, vocabulary 32000.
  g=(--layers 24 --width 1024 --heads 16 --ffn 4096 --sequence 512 --batch 32 --vocab 32000 --stages 1,2,4
     --micro-batches 4 --steps 5 --warmup 2)
  # Table 1 on a 16 GiB share of the GPU (the paper's accelerator had 16 GB): width 512, batch 32 x 512.
  t1=(--width 512 --heads 8 --ffn 2048 --sequence 512 --batch 32 --vocab 1000 --micro-batches 8 --steps 3 --cap 16GiB
      --free "$gpu_free")
fi
# The GPU phases in float32, then in bf16 (autocast; issue 55), each row saying its precision.
phase table2 70 "$bench" table2 "${t2[@]}" --budget 58
phase gpu 55 "$bench" gpu "${g[@]}" --precision fp32,bf16 --budget 45 --trace "$work/device-trace.json"
if [ -n "$python" ]; then
  phase pytorch 40 "$python" bench/device_pytorch.py --layers "${g[1]}" --width "${g[3]}" --heads "${g[5]}" \
    --ffn "${g[7]}" --sequence "${g[9]}" --batch "${g[11]}" --vocab "${g[13]}" --steps 5 --warmup 2 \
    --device "$([ "$smoke" = 1 ] && echo cpu || echo cuda)" --precision fp32 bf16
fi
phase table1 60 "$bench" table1 "${t1[@]}" --precision fp32,bf16 --budget 50

# 5. bench/results/device.json from whatever finished.
mkdir -p "$(dirname "$results")"
"${python:-python3}" - "$work" "$results" "$smoke" <<'PY'
import json, os, sys
work, path, smoke = sys.argv[1], sys.argv[2], sys.argv[3] == "1"

def lines(name):
    rows = []
    try:
        for line in open(os.path.join(work, name + ".out")):
            line = line.strip()
            if line.startswith("{"):
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    pass
    except OSError:
        pass
    return rows

def load(name):
    try:
        return json.load(open(os.path.join(work, name)))
    except (OSError, ValueError):
        return {}

env, cuda = load("env.json"), load("cuda.json")
phases = [json.loads(l) for l in open(os.path.join(work, "phases.jsonl")) if l.strip()]
t2 = lines("table2")
# The base of every cut's speedup: K = 1 (one stage, cut "even") at the same M and threads.
base = {(r["M"], r["threads_per_device"]): r["samples_per_s"] for r in t2
        if r.get("kind") == "table2" and r["K"] == 1 and r.get("cut", "even") == "even"}
table2 = []
for r in t2:
    if r.get("kind") != "table2":
        continue
    b = base.get((r["M"], r["threads_per_device"]))
    table2.append({"K": r["K"], "M": r["M"], "threads_per_device": r["threads_per_device"],
                   "cut": r.get("cut", "even"), "balance": r.get("balance"),
                   "speedup": round(r["samples_per_s"] / b, 3) if b else None, "bubble": round(r["bubble"], 3),
                   "samples_per_s": round(r["samples_per_s"], 2)})
model2 = next((r for r in t2 if r.get("kind") == "table2_model"), {})
gpu = [r for r in lines("gpu") if r.get("kind") == "gpu"]
torch_rows = {(r.get("precision", "fp32"), r["attention"]): r for r in lines("pytorch") if r.get("kind") == "pytorch"}
k1 = {p: next((r for r in gpu if r["K"] == 1 and r.get("precision", "fp32") == p), None) for p in ("fp32", "bf16")}
ratio = lambda a, b: round(a / b, 3) if a and b else None
versus = lambda p, attention: ratio(k1[p] and k1[p]["samples_per_s"],
                                    torch_rows.get((p, attention), {}).get("samples_per_s"))
t1 = lines("table1")
t1_final = {(r.get("precision", "fp32"), r["checkpoint"]): r for r in t1 if r.get("kind") == "table1"}
never, always = t1_final.get(("fp32", "never"), {}), t1_final.get(("fp32", "always"), {})
never16, always16 = t1_final.get(("bf16", "never"), {}), t1_final.get(("bf16", "always"), {})
def prediction(r):
    if not r or not r.get("measured_bytes"):
        return None
    return {"layers": r["layers"], "measured_bytes": r["measured_bytes"], "predicted_bytes": r["predicted_bytes"],
            "predicted_over_measured": ratio(r["predicted_bytes"], r["measured_bytes"])}
out = {
    "device": env.get("device"),
    "torch": env.get("torch"),
    "torch_cuda": env.get("torch_cuda"),
    "smoke": smoke,
    "cuda_exact_max_rel_diff": cuda.get("cuda_exact_max_rel_diff"),
    "cuda_bf16_max_rel_diff": cuda.get("cuda_bf16_max_rel_diff"),
    "cuda_fp16_loss_scale": cuda.get("cuda_fp16_loss_scale"),
    "cpu_vs_cuda_max_rel_diff": cuda.get("cpu_vs_cuda_max_rel_diff") if (cuda.get("cpu_vs_cuda_max_rel_diff") or 0) >= 0 else None,
    "cuda_test": next((p["status"] for p in phases if p["phase"] == "cuda_test"), None),
    "table2_model": {"shape": model2.get("shape"), "parameters": model2.get("parameters"), "blas": model2.get("blas"),
                     "cores": model2.get("cores"), "checkpoint": "except_last", "schedule": "gpipe"},
    "table2": table2,
    "table2_targets": {"K2_M32": 1.8, "K4_M32": 3.4, "K8_M32": 6.3},
    "gpu_model": (k1["fp32"] or k1["bf16"] or {}).get("shape"),
    "gpu": gpu,
    "pytorch": list(torch_rows.values()),
    "gpu_vs_pytorch": versus("fp32", "explicit"),
    "gpu_vs_pytorch_sdpa": versus("fp32", "sdpa"),
    "gpu_vs_pytorch_bf16": versus("bf16", "explicit"),
    "gpu_vs_pytorch_bf16_sdpa": versus("bf16", "sdpa"),
    "gpu_vs_pytorch_bf16_target": 0.95,
    "table1_setup": next((r for r in t1 if r.get("kind") == "table1_setup"), None),
    "table1_never_layers": never.get("layers"),
    "table1_always_layers": always.get("layers"),
    "table1_complete": bool(never.get("complete") and always.get("complete")),
    "table1_ratio": ratio(always.get("layers"), never.get("layers")),
    "predictions": {"never": prediction(never), "always": prediction(always)},
    "table1_bf16": {"never_layers": never16.get("layers"), "always_layers": always16.get("layers"),
                    "ratio": ratio(always16.get("layers"), never16.get("layers")),
                    "predictions": {"never": prediction(never16), "always": prediction(always16)}},
    "table1_trials": [r for r in t1 if r.get("kind") == "table1_trial"],
    "skipped": [r for name in ("table2", "gpu", "table1") for r in lines(name) if r.get("kind", "").endswith("_skipped")],
    "phases": phases,
}
tmp = path + ".tmp"
with open(tmp, "w") as f:
    json.dump(out, f, indent=1)
    f.write("\n")
os.replace(tmp, path)
print(json.dumps({k: out[k] for k in ("device", "torch", "cuda_exact_max_rel_diff", "cuda_bf16_max_rel_diff",
                                      "gpu_vs_pytorch", "gpu_vs_pytorch_bf16", "table1_ratio")}))
for r in table2:
    print("table2", r)
PY
status=$?
log "results: $results (status $status)"
if [ -n "$out" ]; then
  mkdir -p "$out"
  cp "$results" "$out/device.json" 2>/dev/null
  [ -f "$work/device-trace.json" ] && cp "$work/device-trace.json" "$out/"
  # At most 8 files come back from the machine: the logs travel as one archive.
  tar -czf "$out/logs.tar.gz" -C "$work" --exclude device-trace.json . 2>/dev/null
fi
[ -f "$work/device-trace.json" ] && [ "$smoke" != 1 ] && cp "$work/device-trace.json" bench/results/device-trace.json
exit $status
