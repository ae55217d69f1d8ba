#!/usr/bin/env bash
# mpi_cli_test.sh: `mpirun -np N gpipe train`, one stage per rank: the same parameters as one
# process, one checkpoint file resumed with any K, and errors and faults that end every rank quickly.
# Usage: [GPIPE_TEST_PART=PART] mpi_cli_test.sh PATH/TO/gpipe   (parts: tests/parts_lib.sh)
set -u
gpipe="$1"
source "$(dirname "$0")/test_lib.sh"
small=(--train-samples 1024 --test-samples 200 --epochs 2 --json)
checksum() { /usr/bin/python3 -c 'import json,sys; print(repr(json.load(open(sys.argv[1]))["parameter_checksum"]))' "$1"; }
source "$tests_dir/parts_lib.sh"
# A command still running after this has hung (they take seconds on a quiet machine; the margin is
# for a loaded one).
hang=240

# same_as_one "NP ARGS"...: one stage per rank gives the parameters of one process, bit for bit
# (Dropout included). Without a schedule named, both run the task's own (the default, auto, predicts
# its choice from a profile, which may choose differently in two runs: part `auto` tests it).
same_as_one() {
  local case np args
  for case in "$@"; do
    read -r np args <<<"$case"
    [[ "$args" == *--schedule* ]] || args="$args --schedule task"
    if "$gpipe" train "${small[@]}" --steps 10 $args >"$work/one.json" 2>/dev/null &&
       bash "$mpirun_sh" "$np" "$gpipe" train "${small[@]}" --steps 10 $args >"$work/mpi.json" 2>"$work/mpi.err"; then
      a=$(checksum "$work/one.json"); b=$(checksum "$work/mpi.json")
      if [ "$a" = "$b" ]; then pass "np=$np $args: parameters equal one process ($a)"
      else fail "np=$np $args: checksum $b, one process $a"; fi
    else fail "np=$np $args exited non-zero"; tail -5 "$work/mpi.err"; fi
  done
}

# Errors: each before any training, on every rank, a non-zero exit, not a hang.
expect_error() {  # NAME PATTERN COMMAND...
  local name="$1" pattern="$2"
  shift 2
  local begin=$SECONDS status
  timeout -k 10 "$hang" "$@" </dev/null >"$work/err.out" 2>&1
  status=$?
  if [ "$status" = 0 ]; then fail "$name: exited 0"; return; fi
  if [ "$status" = 124 ]; then fail "$name: still running after $hang s: hung"; tail -20 "$work/err.out"; return; fi
  if grep -q -- "$pattern" "$work/err.out"; then pass "$name (exit $status, $((SECONDS - begin)) s)"
  else fail "$name: no \"$pattern\""; tail -20 "$work/err.out"; fi
}

if part same; then  # cost 20
  same_as_one "2 --stages 2" "3 --stages 3 --checkpoint always --micro-batches 3"
fi

if part same_v; then  # cost 22
  same_as_one "2 --stages 2 --virtual-stages 2 --schedule interleaved --micro-batches 4" \
              "2 --stages 2 --schedule zbv --micro-batches 4 --checkpoint except_last"
fi

if part launch; then  # cost 25
  # The GPT with its embedding on rank 0 and the head tied to it on rank 1 (the copies' gradients
  # summed): the parameters of one process, up to the order of that sum's additions.
  if [ -d /usr/share/games/fortunes ]; then
    gpt=(--model gpt --schedule task --train-samples 32 --test-samples 4 --batch-size 8 --steps 3 --json)
    if "$gpipe" train "${gpt[@]}" >"$work/gpt-one.json" 2>/dev/null &&
       bash "$mpirun_sh" 2 "$gpipe" train "${gpt[@]}" >"$work/gpt-mpi.json" 2>"$work/mpi.err" &&
       /usr/bin/python3 - "$work/gpt-one.json" "$work/gpt-mpi.json" <<'PY'
import json, sys
one, mpi = (json.load(open(f)) for f in sys.argv[1:3])
assert mpi["mpi"]["ranks"] == 2 and mpi["balance"] == [3, 4], mpi
assert abs(one["parameter_checksum"] - mpi["parameter_checksum"]) <= 1e-5 * abs(one["parameter_checksum"]), (one, mpi)
assert abs(one["test_bits_per_byte"] - mpi["test_bits_per_byte"]) <= 1e-4, (one["test_bits_per_byte"], mpi["test_bits_per_byte"])
PY
    then pass "np=2 --model gpt: embedding and tied head on two ranks, as one process"
    else fail "np=2 --model gpt"; tail -5 "$work/mpi.err"; fi
  fi

  # gpipe bench under mpirun: the same sweep, a rank per device.
  if bash "$mpirun_sh" 2 "$gpipe" bench --workload tiny --stages 2 --micro-batches 4 --steps 2 --warmup 1 --json \
       --results "" >"$work/bench.jsonl" 2>"$work/bench.err" &&
     /usr/bin/python3 - "$work/bench.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
assert len(rows) == 1, rows
r = rows[0]
assert r["transport"] == "mpi" and r["stages"] == 2 and r["replicas"] == 1 and r["samples_per_s"] > 0
assert r["bytes_sent_per_step"] > 0 and "speedup" not in r
PY
  then pass "gpipe bench under mpirun: one row, over MPI"
  else fail "gpipe bench under mpirun"; cat "$work/bench.err"; fi
  # --schedule auto under mpirun: rank 0 profiles and chooses, both ranks run its choice.
  if bash "$mpirun_sh" 2 "$gpipe" bench --workload tiny --stages 2 --micro-batches 4 --steps 2 --warmup 1 --json \
       --schedule auto --results "" >"$work/bench-auto.jsonl" 2>"$work/bench.err" &&
     /usr/bin/python3 - "$work/bench-auto.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
assert len(rows) == 1 and rows[0]["schedule"].startswith("auto:") and rows[0]["samples_per_s"] > 0, rows
PY
  then pass "gpipe bench --schedule auto under mpirun: rank 0's choice, $(grep -o '"schedule": *"[^"]*"' "$work/bench-auto.jsonl")"
  else fail "gpipe bench --schedule auto under mpirun"; cat "$work/bench.err"; fi

  # --trace under MPI: rank 0 gathers every stage's actions of the last step (the task's own: 4 stages
  # interleaved over the 2 ranks, stages 0 and 2 on rank 0, 1 and 3 on rank 1).
  if bash "$mpirun_sh" 2 "$gpipe" train "${small[@]}" --schedule task --steps 2 --micro-batches 6 --trace "$work/trace.json" \
       >/dev/null 2>&1 &&
     /usr/bin/python3 - "$work/trace.json" <<'PY'
import json, sys
events = [e for e in json.load(open(sys.argv[1]))["traceEvents"] if e["ph"] == "X"]
for device in (0, 1):
    names = sorted(e["name"] for e in events if e["tid"] == device and e["cat"] != "update")
    assert names == sorted(f"{s}{p}{i}" for s in (device, device + 2) for p in "FB" for i in range(6)), names
    updates = sorted(e["name"] for e in events if e["tid"] == device and e["cat"] == "update")
    assert updates == [f"{device}U", f"{device + 2}U"], updates  # the step before's, gathered too
PY
  then pass "--trace: rank 0 writes both ranks' 24 actions and their stages' updates"
  else fail "--trace under mpirun"; fi

  # 2 stages x 2 replicas: trains, one summary from rank 0, which names the layout.
  if bash "$mpirun_sh" 4 "$gpipe" train --train-samples 1024 --test-samples 200 --epochs 1 \
       >"$work/dp.txt" 2>"$work/dp.err"; then
    if [ "$(grep -c '^summary' "$work/dp.txt")" = 1 ] && grep -q "4 ranks = 2 devices x 2 replicas" "$work/dp.txt" &&
       [ "$(grep -c 'step 8/8' "$work/dp.err")" = 1 ]; then
      pass "np=4: 2 devices x 2 replicas; rank 0 alone prints progress and the summary"
    else fail "np=4 output"; cat "$work/dp.txt"; fi
  else fail "np=4 exited non-zero"; tail -5 "$work/dp.err"; fi
fi

if part resume; then  # cost 43
  # --save writes one file, gathered by rank 0; a resume from it equals an unbroken run, with the
  # same K or another one, under mpirun or in one process. The task's own schedule: auto's choice,
  # predicted from a profile, may differ between the runs compared.
  local_small=("${small[@]}" --schedule task)
  if bash "$mpirun_sh" 2 "$gpipe" train "${local_small[@]}" --steps 4 --save "$work/ckpt.pt" >/dev/null 2>&1 &&
     [ -s "$work/ckpt.pt" ] && [ -z "$(ls "$work" | grep -e '\.stage' -e '\.tmp')" ] &&
     bash "$mpirun_sh" 2 "$gpipe" train "${local_small[@]}" --steps 10 --resume "$work/ckpt.pt" >"$work/resumed.json" 2>/dev/null; then
    bash "$mpirun_sh" 2 "$gpipe" train "${local_small[@]}" --steps 10 >"$work/unbroken.json" 2>/dev/null
    a=$(checksum "$work/unbroken.json"); b=$(checksum "$work/resumed.json")
    if [ "$a" = "$b" ]; then pass "one file saved at step 4 by 2 ranks, resumed to 10: equals 10 unbroken steps"
    else fail "resume: $b, unbroken: $a"; fi
  else fail "save/resume under mpirun"; fi
  # Another K: 3 ranks resume the 2-rank file; one process resuming it with K=3 gets the same parameters.
  if bash "$mpirun_sh" 3 "$gpipe" train "${local_small[@]}" --steps 10 --stages 3 --resume "$work/ckpt.pt" \
       >"$work/k3-mpi.json" 2>"$work/k3.err" &&
     "$gpipe" train "${local_small[@]}" --steps 10 --stages 3 --resume "$work/ckpt.pt" >"$work/k3-one.json" 2>>"$work/k3.err"; then
    a=$(checksum "$work/k3-one.json"); b=$(checksum "$work/k3-mpi.json")
    if [ "$a" = "$b" ]; then pass "a 2-rank checkpoint resumed by 3 ranks equals one process resuming it ($a)"
    else fail "resume with K=3: mpirun $b, one process $a"; fi
  else fail "resume with another K"; tail -5 "$work/k3.err"; fi
  # --per-device-files: one file per device, resumed with the same K (by the flag's old name,
  # --per-stage-files, which is kept).
  if bash "$mpirun_sh" 2 "$gpipe" train "${local_small[@]}" --steps 4 --save "$work/split.pt" --per-device-files \
       >/dev/null 2>&1 &&
     [ -s "$work/split.pt.stage0-of-2" ] && [ -s "$work/split.pt.stage1-of-2" ] && [ ! -e "$work/split.pt" ] &&
     bash "$mpirun_sh" 2 "$gpipe" train "${local_small[@]}" --steps 10 --resume "$work/split.pt" --per-stage-files \
       >"$work/split.json" 2>/dev/null; then
    a=$(checksum "$work/unbroken.json"); b=$(checksum "$work/split.json")
    if [ "$a" = "$b" ]; then pass "--per-device-files: saved at step 4, resumed to 10: equals 10 unbroken steps"
    else fail "--per-device-files resume: $b, unbroken: $a"; fi
  else fail "--per-device-files save/resume"; fi
fi

if part errors; then  # cost 53
  # The files of the resume part: one whole file and per-device files, both of step 4.
  bash "$mpirun_sh" 2 "$gpipe" train "${small[@]}" --steps 4 --save "$work/ckpt.pt" >/dev/null 2>&1
  bash "$mpirun_sh" 2 "$gpipe" train "${small[@]}" --steps 4 --save "$work/split.pt" --per-device-files >/dev/null 2>&1
  expect_error "per-stage files saved with another K are refused" "no such file: $work/split.pt.stage0-of-3" \
    bash "$mpirun_sh" 3 "$gpipe" train "${small[@]}" --stages 3 --resume "$work/split.pt" --per-stage-files
  # Per-device files and whole files mixed up: each error names the files there are and the fix.
  expect_error "per-device files resumed by one process" "there are per-device files $work/split.pt.stage0-of-2 ..., one per rank of a job: resume them under mpirun -np 2 or torchrun --nproc_per_node 2" \
    "$gpipe" train "${small[@]}" --resume "$work/split.pt"
  expect_error "a whole file resumed with --per-device-files" "ckpt.pt is one whole checkpoint file, not a set of per-device files: leave out --per-device-files" \
    bash "$mpirun_sh" 2 "$gpipe" train "${small[@]}" --resume "$work/ckpt.pt" --per-device-files
  expect_error "per-device files resumed with another schedule" "resume them with the same --stages, --balance, --schedule and --virtual-stages" \
    bash "$mpirun_sh" 2 "$gpipe" train "${small[@]}" --resume "$work/split.pt" --per-device-files --schedule zbv
  # A device's file from a run with another --seed: refused before step 1 (its data order differs).
  if bash "$mpirun_sh" 2 "$gpipe" train "${small[@]}" --steps 4 --seed 7 --save "$work/seed7.pt" --per-device-files \
       >/dev/null 2>&1; then
    cp "$work/split.pt.stage0-of-2" "$work/mixed.pt.stage0-of-2"
    cp "$work/seed7.pt.stage1-of-2" "$work/mixed.pt.stage1-of-2"
    cp "$work/split.pt.manifest" "$work/mixed.pt.manifest"
    expect_error "per-device files of two runs" "the per-device files of $work/mixed.pt are of different runs" \
      bash "$mpirun_sh" 2 "$gpipe" train "${small[@]}" --steps 10 --resume "$work/mixed.pt" --per-device-files
    if grep -q "step 5" "$work/err.out"; then fail "per-device files of two runs: trained before the error"; fi
  else fail "--per-device-files with --seed 7"; fi
  expect_error "np not a multiple of K" "the job has 3 ranks, not a multiple of the 2 devices" \
    bash "$mpirun_sh" 3 "$gpipe" train "${small[@]}"
  expect_error "ranks started with different settings" \
    "rank 0 has --micro-batches 4, rank 1 has 8" \
    bash "$mpirun_sh" 1 "$gpipe" train "${small[@]}" --micro-batches 4 : -np 1 "$gpipe" train "${small[@]}" --micro-batches 8
  if [ "$(grep -c 'different settings' "$work/err.out")" = 1 ]; then pass "the settings error, the same on both ranks, is printed once"
  else fail "settings error printed $(grep -c 'different settings' "$work/err.out") times"; cat "$work/err.out"; fi
  expect_error "a flag one rank alone was given" "rank 0 has no --lr, rank 1 has --lr 0.01" \
    bash "$mpirun_sh" 1 "$gpipe" train "${small[@]}" : -np 1 "$gpipe" train "${small[@]}" --lr 0.01
  # The same settings in another order, or written --flag=value, are the same settings.
  if bash "$mpirun_sh" 1 "$gpipe" train "${small[@]}" --steps 1 --seed 3 --micro-batches 4 \
       : -np 1 "$gpipe" train --micro-batches=4 --seed=3 --steps 1 "${small[@]}" >"$work/order.out" 2>"$work/order.err"
  then pass "flags in another order and --flag=value: the same settings"
  else fail "flags in another order: $(tail -3 "$work/order.err")"; fi
  expect_error "a usage error under mpirun" "gpipe: --betas: takes 2 values separated by commas (got 3)" \
    bash "$mpirun_sh" 2 "$gpipe" train "${small[@]}" --betas 0.9,0.99,0.5
  if [ "$(grep -c -- '--betas' "$work/err.out")" = 1 ] && ! grep -q "\[rank" "$work/err.out"; then
    pass "a usage error every rank makes is printed once, without a rank"
  else fail "usage error under mpirun"; cat "$work/err.out"; fi
fi

if part own_files; then  # cost 33
  # Each rank in its own working folder, with files of the same name but other bytes: refused before
  # training, naming the input (they would train a mixture of two models or datasets).
  if /usr/bin/python3 - "$work" <<'PY'
import sys, torch
work = sys.argv[1]
for rank, seed in ((0, 0), (1, 1)):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    import os
    os.makedirs(f"{work}/rank{rank}", exist_ok=True)
    torch.jit.script(model).save(f"{work}/rank{rank}/model.pt")
    torch.manual_seed(0)
    torch.save({"input": torch.randn(40, 6), "target": torch.randn(40, 3) + rank}, f"{work}/rank{rank}/data.pt")
PY
  then
    cp "$work/rank0/model.pt" "$work/rank0/same.pt"; cp "$work/rank0/model.pt" "$work/rank1/same.pt"
    own=(train --data data.pt --loss mse --stages 2 --steps 2)
    expect_error "ranks reading other --model bytes" "rank 1 read other bytes than rank 0 behind --model model.pt" \
      bash "$mpirun_sh" 1 --wdir "$work/rank0" "$gpipe" "${own[@]}" --model model.pt : -np 1 --wdir "$work/rank1" "$gpipe" "${own[@]}" --model model.pt
    expect_error "ranks reading other --data bytes" "rank 1 read other bytes than rank 0 behind --data data.pt" \
      bash "$mpirun_sh" 1 --wdir "$work/rank0" "$gpipe" "${own[@]}" --model same.pt : -np 1 --wdir "$work/rank1" "$gpipe" "${own[@]}" --model same.pt
    # --per-device-files of a TorchScript model at np 4 (2 devices x 2 replicas): saved at step 3,
    # resumed by the same command with --resume, equal to 10 unbroken steps.
    script=(train --model "$work/rank0/same.pt" --data "$work/rank0/data.pt" --loss mse --stages 2 --batch-size 8
            --epochs 2 --optimizer sgd --lr 0.05 --schedule task --json)  # as the per-device files run
    if bash "$mpirun_sh" 4 "$gpipe" "${script[@]}" >"$work/s4-unbroken.json" 2>/dev/null &&
       bash "$mpirun_sh" 4 "$gpipe" "${script[@]}" --steps 3 --save "$work/s4.pt" --per-device-files >/dev/null 2>&1 &&
       bash "$mpirun_sh" 4 "$gpipe" "${script[@]}" --resume "$work/s4.pt" --per-device-files >"$work/s4-resumed.json" \
         2>"$work/err.out" && [ "$(checksum "$work/s4-resumed.json")" = "$(checksum "$work/s4-unbroken.json")" ]; then
      pass "--per-device-files of a TorchScript model at np 4: saved at step 3, resumed: equals unbroken"
    else fail "--per-device-files of a TorchScript model at np 4"; tail -3 "$work/err.out"; fi
  else echo "skipped: ranks reading other bytes, TorchScript per-device files (no python3-torch)"; fi

  # --samples under mpirun with 2 replicas: 8 test images in the picture, as in one process.
  if bash "$mpirun_sh" 4 "$gpipe" train --model unet --stages 2 --train-samples 64 --test-samples 64 --batch-size 16 \
       --steps 1 --samples "$work/samples.png" >/dev/null 2>"$work/err.out" &&
     /usr/bin/python3 -c 'import struct,sys; png = open(sys.argv[1], "rb").read(); assert struct.unpack(">II", png[16:24]) == (8 * 58, 3 * 58)' \
       "$work/samples.png"; then pass "--samples at np 4 (2 replicas): 8 test images, as in one process"
  else fail "--samples under mpirun"; tail -3 "$work/err.out"; fi
fi

if part faults; then  # cost 12
  # Faults (GPIPE_TEST_FAULT is a test-only switch): a stage that throws, a rank that dies. The task's
  # own schedule, whose last stage (3) is rank 1's.
  local_small=("${small[@]}" --schedule task)
  expect_error "an exception in rank 1's stage ends every rank, with its message" \
    "\[rank 1\] gpipe: stage 3 failed in the forward of micro-batch 0 (action 3F0, input \[[0-9, ]*\]): injected fault" \
    env GPIPE_TEST_FAULT=throw:3 bash "$mpirun_sh" 2 "$gpipe" train "${local_small[@]}"
  if grep -q "\[rank 0\] gpipe: stopped because rank 1 failed: rank 1 (device 1, replica 0): gpipe: stage 3 failed" \
       "$work/err.out"; then pass "rank 0 reports rank 1's message too"
  else fail "rank 0's report"; tail -20 "$work/err.out"; fi
  expect_error "a rank that dies ends the job" "Exit code:    3" \
    env GPIPE_TEST_FAULT=exit:1:3 bash "$mpirun_sh" 3 "$gpipe" train "${local_small[@]}" --stages 3
fi

if part auto; then  # cost 30
  # `schedule` auto by default: rank 0 profiles and chooses, every rank takes its choice (the ranks'
  # plans are compared before any work), and the run gives the parameters of one process running
  # that choice, named.
  if bash "$mpirun_sh" 2 "$gpipe" train "${small[@]}" --steps 6 >"$work/auto-mpi.json" 2>"$work/mpi.err" &&
     named=$(/usr/bin/python3 - "$work/auto-mpi.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
assert j["auto"]["predicted_step_s"] > 0 and j["auto"]["configurations"] > 1, j["auto"]
print(f"--schedule {j['schedule']} --micro-batches {j['micro_batches']} --virtual-stages {j['virtual_stages']} "
      f"--balance {','.join(map(str, j['balance']))} --checkpoint {j['checkpoint']}")
PY
     ) && "$gpipe" train "${small[@]}" --steps 6 $named >"$work/auto-one.json" 2>>"$work/mpi.err"; then
    # Equal up to the order in which a V schedule's stages sum a gradient (rank 0's order by the stages'
    # times; one process names none): 1e-6 of the sum.
    a=$(checksum "$work/auto-one.json"); b=$(checksum "$work/auto-mpi.json")
    if /usr/bin/python3 -c 'import sys; a, b = map(float, sys.argv[1:]); sys.exit(abs(a - b) > 1e-6 * abs(a))' "$a" "$b"
    then pass "np=2, auto: rank 0's choice ($named) taken by both ranks: parameters as one process's ($a, $b)"
    else fail "np=2, auto ($named): checksum $b, one process $a"; fi
  else fail "np=2 with schedule auto"; tail -5 "$work/mpi.err"; fi
  # A model rank 0 cannot profile (a layer that changes its input in place only where it takes a
  # gradient): the task's own schedule runs on both ranks, said once; asked for by name, auto fails on both.
  # (from a file: TorchScript reads a class's source)
  cat >"$work/in_place.py" <<'PY'
import sys, torch
work = sys.argv[1]
class AddOneWithAGraph(torch.nn.Module):
    def forward(self, x):
        if x.requires_grad:
            x.add_(1.0)
        return x
torch.jit.script(torch.nn.Sequential(torch.nn.Linear(6, 8), AddOneWithAGraph(), torch.nn.Linear(8, 8),
                                     torch.nn.Linear(8, 3))).save(f"{work}/in-place.pt")
torch.save({"input": torch.randn(32, 6), "target": torch.randn(32, 3)}, f"{work}/data.pt")
PY
  /usr/bin/python3 "$work/in_place.py" "$work"
  in_place=(--model "$work/in-place.pt" --data "$work/data.pt" --loss mse --stages 2 --balance 2,2 --batch-size 8 --steps 2)
  if timeout -k 10 "$hang" bash "$mpirun_sh" 2 "$gpipe" train "${in_place[@]}" </dev/null >"$work/err.out" 2>&1; then
    said=$(grep -c "could not profile the model, so the task's own schedule runs: layer 1 ('1') changes its input in place" "$work/err.out")
    if [ "$said" = 1 ]; then pass "np=2, a model rank 0 cannot profile: the task's own schedule runs, said once"
    else fail "np=2, a model rank 0 cannot profile: the fallback said $said times"; tail -5 "$work/err.out"; fi
  else fail "np=2, a model rank 0 cannot profile: exited non-zero"; tail -5 "$work/err.out"; fi
  expect_error "np=2, --schedule auto on a model rank 0 cannot profile" "rank 0 could not profile the model" \
    bash "$mpirun_sh" 2 "$gpipe" train "${in_place[@]}" --schedule auto
fi

if part precision; then  # cost 14
  # A gradient that overflows on rank 1 alone (its stage, the last) skips the step on both ranks, as one
  # process skips it where the same stage's gradient overflows: the same parameters, one step skipped,
  # the scale halved from 65536.
  scaled=(--train-samples 256 --test-samples 64 --epochs 1 --steps 4 --json --stages 2 --schedule task --loss-scale dynamic)
  if env GPIPE_TEST_FAULT=inf:0:1 "$gpipe" train "${scaled[@]}" >"$work/ls-one.json" 2>"$work/err.out" &&
     env GPIPE_TEST_FAULT=inf:1:1 bash "$mpirun_sh" 2 "$gpipe" train "${scaled[@]}" >"$work/ls-mpi.json" 2>>"$work/err.out" &&
     "$gpipe" train "${scaled[@]}" >"$work/ls-none.json" 2>>"$work/err.out" &&
     /usr/bin/python3 - "$work/ls-one.json" "$work/ls-mpi.json" "$work/ls-none.json" <<'PY'
import json, sys
one, mpi, none = (json.load(open(f)) for f in sys.argv[1:])
for run in (one, mpi):
    assert run["skipped_steps"] == 1 and run["loss_scale"] == 32768, run
assert one["parameter_checksum"] == mpi["parameter_checksum"], (one["parameter_checksum"], mpi["parameter_checksum"])
assert none["skipped_steps"] == 0 and none["parameter_checksum"] != one["parameter_checksum"], none
PY
  then pass "an overflow on rank 1 skips the step on both ranks: the parameters of one process, scale 32768"
  else fail "the loss scale under mpirun"; tail -5 "$work/err.out"; fi
  # Per-device files of a bf16 run, resumed under mpirun without --precision: refused, naming the fix
  # (in one process the file's precision is taken; here it is known only once the files are read).
  if bash "$mpirun_sh" 2 "$gpipe" train "${scaled[@]}" --precision bf16 --save "$work/bf16.pt" --per-device-files \
       >/dev/null 2>>"$work/err.out"; then
    expect_error "per-device bf16 files resumed without --precision" "was trained in bf16; give --precision bf16" \
      bash "$mpirun_sh" 2 "$gpipe" train "${scaled[@]}" --resume "$work/bf16.pt" --per-device-files
  else fail "saving bf16 per-device files under mpirun"; tail -5 "$work/err.out"; fi
fi

parts_end || failures=$((failures + 1))
finish
