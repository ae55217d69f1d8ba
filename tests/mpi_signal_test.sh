#!/usr/bin/env bash
# mpi_signal_test.sh: `mpirun gpipe train --save` that is stopped or loses a rank. SIGTERM to mpirun
# (which sends SIGTERM to every rank a second later, and SIGKILL a second after that) leaves one
# whole file that resumes to the parameters of an unbroken run; a closed standard output loses
# nothing; a rank killed with SIGKILL ends the job, and the last file saved by
# --save-every resumes, with the same or another number of ranks, to the unbroken parameters;
# per-stage files of a TorchScript model resume, and a rank killed while they are written leaves a
# set that still resumes (the manifest names its step) or is refused clearly.
# Usage: [GPIPE_TEST_PART=PART] mpi_signal_test.sh PATH/TO/gpipe   (parts: tests/parts_lib.sh)
set -u
gpipe="$1"
mpirun_sh="$(dirname "$0")/mpirun.sh"
work=$(mktemp -d -t gpipe-mpi-signal-test.XXXXXX)
source "$(dirname "$0")/signal_lib.sh"
source "$(dirname "$0")/parts_lib.sh"
run=(train --schedule task --train-samples 640 --test-samples 100 --batch-size 64 --epochs 3 --json)  # 10 steps an epoch

rank_pid() {  # MPIRUN_PID RANK: the pid of that rank (mpirun starts the ranks here as its children)
  local p try
  for try in 1 2 3 4 5 6 7 8 9 10; do
    for p in $(pgrep -P "$1"); do
      if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$2"; then echo "$p"; return; fi
    done
    sleep 0.1
  done
}

# make_unbroken: the parameters of 30 unbroken steps in one process, in $unbroken.
make_unbroken() {
  "$gpipe" "${run[@]}" >"$work/unbroken.json" 2>/dev/null || fail "the unbroken run failed"
  unbroken=$(checksum "$work/unbroken.json")
}

# 1. SIGTERM to mpirun at a random step: one whole file, resumed under mpirun and in one process.
# mpirun sends the ranks SIGTERM odls_base_sigkill_timeout seconds after its own, and SIGKILL as
# long after that (1 s by default, too short for a step and a save on a loaded test machine):
# 3 s here. The run is of 1,000 steps, so that it is still running when the ranks get the signal on
# any machine (a fast one runs 60 steps in under 2 s); the unbroken run and the resumed ones end 10
# steps after the stop (--steps). (Another K resumes too, but the CNN's Dropout masks are seeded per
# stage: only the same K gives the unbroken run's parameters bit for bit; mpi_cli_test covers another K.)
sigterm_trials() {  # TRIAL...
  local trial end
  long=(train --schedule task --train-samples 640 --test-samples 100 --batch-size 64 --epochs 100 --json)  # 1,000 steps
  for trial in "$@"; do
    step=$((RANDOM % 10 + 1))
    rm -f "$work/run.pt"
    rm -f "$work/err.txt"  # the new run's lines only: wait_for reads it at once
    bash "$mpirun_sh" 2 --mca odls_base_sigkill_timeout 3 "$gpipe" "${long[@]}" --save "$work/run.pt" \
      >/dev/null 2>"$work/err.txt" &
    pid=$!
    pids+=("$pid")
    if ! wait_for "$work/err.txt" "epoch 1/100 step $step/10" "$pid"; then fail "SIGTERM: no step line"; continue; fi
    kill -TERM "$pid"
    wait "$pid"
    rc=$?
    stopped=$(grep -o "stopped by SIGTERM at step [0-9]*" "$work/err.txt" | grep -o "[0-9]*$")
    if [ ! -s "$work/run.pt" ] || [ -z "$stopped" ]; then
      fail "SIGTERM to mpirun after step $step: no file, or no stop (exit $rc)"; tail -3 "$work/err.txt"; continue
    fi
    no_temporaries || fail "SIGTERM to mpirun: a temporary file was left: $(ls "$work")"
    # The printed command keeps mpirun's own flags (tests/mpirun.sh's --oversubscribe, the kill timeout).
    resume=$(sed -n 's/^gpipe: resume with: //p' "$work/err.txt")
    case "$resume" in
      "mpirun --oversubscribe "*"--mca odls_base_sigkill_timeout 3 "*) ;;
      *) fail "SIGTERM to mpirun: the resume command drops mpirun's flags: $resume" ;;
    esac
    end=$((stopped + 10))
    if "$gpipe" "${long[@]}" --steps "$end" >"$work/long.json" 2>/dev/null &&
       eval "$resume --steps $end" >"$work/mpi.json" 2>/dev/null &&
       "$gpipe" "${long[@]}" --steps "$end" --resume "$work/run.pt" >"$work/one.json" 2>/dev/null &&
       long_unbroken=$(checksum "$work/long.json") &&
       [ "$(checksum "$work/mpi.json")" = "$long_unbroken" ] && [ "$(checksum "$work/one.json")" = "$long_unbroken" ] &&
       grep -q '"steps_this_run": 10,' "$work/mpi.json"; then
      pass "SIGTERM to mpirun after step $step: every rank stopped at step $stopped, saved (exit $rc); resumed to step $end by the printed mpirun command and by 1 process: equals unbroken"
    else fail "SIGTERM to mpirun after step $step: resume from step $stopped to $end differs from unbroken"; fi
  done
}

# 3. A rank killed with SIGKILL: the job ends (it does not hang); the last file --save-every wrote resumes,
# in one process or by 2 ranks (which saves again: the killed writer's temporary file goes), to the
# unbroken parameters.
kill_rank_trials() {  # RANK...
  local victim
  for victim in "$@"; do
    rm -f "$work/run.pt"
    rm -f "$work/err.txt"  # the new run's lines only: wait_for reads it at once
    bash "$mpirun_sh" 2 "$gpipe" "${run[@]}" --save "$work/run.pt" --save-every 3 >/dev/null 2>"$work/err.txt" &
    pid=$!
    pids+=("$pid")
    step=$((RANDOM % 10 + 1))
    if ! wait_for "$work/err.txt" "epoch 2/3 step $step/10" "$pid"; then fail "SIGKILL: no step line"; continue; fi
    victim_pid=$(rank_pid "$pid" "$victim")
    if [ -z "$victim_pid" ]; then fail "rank $victim: no process found"; wait "$pid"; continue; fi
    kill -9 "$victim_pid"
    begin=$SECONDS
    wait_bounded "$pid" 240
    rc=$?
    took=$((SECONDS - begin))
    if [ "$rc" = 124 ]; then fail "rank $victim killed: the job still ran $took s later: hung"; continue; fi
    at=$("$gpipe" "${run[@]}" --resume "$work/run.pt" \
         >"$work/one.json" 2>/dev/null && /usr/bin/python3 -c \
         'import json,sys; s=json.load(open(sys.argv[1])); print(s["steps"]-s["steps_this_run"])' "$work/one.json")
    if [ -n "$at" ] && [ "$(checksum "$work/one.json")" = "$unbroken" ] &&
       bash "$mpirun_sh" 2 "$gpipe" "${run[@]}" --resume "$work/run.pt" --save "$work/run.pt" >"$work/mpi.json" 2>/dev/null &&
       [ "$(checksum "$work/mpi.json")" = "$unbroken" ]; then
      pass "rank $victim killed after step $((10 + step)): the job ended in $took s; the file (step $at) resumed in 1 process and by 2 ranks: equals unbroken"
    else fail "rank $victim killed after step $((10 + step)): the file does not resume to unbroken"; fi
    no_temporaries || fail "a temporary file is left after the resumed run saved: $(ls "$work")"
  done
}

# 4. Per-stage files of a TorchScript model (a model saved from Python). make_script: the model, its
# data, $script (the run) and $s_unbroken (its unbroken parameters at np 2); fails without torch.
make_script() {
  if ! /usr/bin/python3 -c "import torch" 2>/dev/null; then
    echo "skipped: the TorchScript per-stage cases need Debian's python3-torch"
    return 1
  fi
  /usr/bin/python3 - "$work" <<'PY'
import sys, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                            torch.nn.Linear(16, 3))
torch.jit.script(model).save(f"{sys.argv[1]}/model.pt")
torch.save({"input": torch.randn(96, 6), "target": torch.randn(96, 3)}, f"{sys.argv[1]}/data.pt")
PY
  script=(train --model "$work/model.pt" --data "$work/data.pt" --loss mse --batch-size 8 --epochs 20 --optimizer sgd
          --lr 0.05 --schedule task --json)  # 12 steps an epoch; auto's choice could differ between runs
  bash "$mpirun_sh" 2 "$gpipe" "${script[@]}" >"$work/s-unbroken.json" 2>/dev/null
  s_unbroken=$(checksum "$work/s-unbroken.json")
}

if part sigterm; then  # cost 38
  sigterm_trials 1
fi

if part sigterm_again; then  # cost 38
  sigterm_trials 2
fi

if part head; then  # cost 31
  make_unbroken
  # 2. A closed standard output under mpirun: the training goes on, its file is whole.
  rm -f "$work/sp.pt"
  bash "$mpirun_sh" 2 "$gpipe" train --schedule task --train-samples 640 --test-samples 100 --batch-size 64 --epochs 3 \
    --save "$work/sp.pt" 2>"$work/err.txt" | head -1 >/dev/null
  if "$gpipe" "${run[@]}" --resume "$work/sp.pt" >"$work/resumed.json" 2>/dev/null &&
     /usr/bin/python3 - "$work/resumed.json" "$unbroken" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
assert s["steps_this_run"] == 0 and repr(s["parameter_checksum"]) == sys.argv[2], s
PY
  then pass "mpirun ... | head -1: the whole run is saved (30 steps, unbroken parameters)"
  else fail "mpirun ... | head -1 lost the file"; cat "$work/err.txt"; fi
fi

if part kill_rank1; then  # cost 36
  make_unbroken
  kill_rank_trials 1
fi

if part kill_rank0; then  # cost 36
  make_unbroken
  kill_rank_trials 0
fi

if part script_files; then  # cost 36
  if make_script; then
    # Saved and resumed at np 2.
    if bash "$mpirun_sh" 2 "$gpipe" "${script[@]}" --steps 7 --save "$work/split.pt" --per-stage-files \
         >/dev/null 2>"$work/err.txt" &&
       bash "$mpirun_sh" 2 "$gpipe" "${script[@]}" --resume "$work/split.pt" --per-stage-files \
         >"$work/s-resumed.json" 2>"$work/err.txt" && [ "$(checksum "$work/s-resumed.json")" = "$s_unbroken" ]; then
      pass "--per-stage-files of a TorchScript model at np 2: saved at step 7, resumed: equals unbroken"
    else fail "--per-stage-files of a TorchScript model"; tail -5 "$work/err.txt"; fi
    # Stage files of two steps without the one the manifest names: refused, saying so.
    rm -f "$work"/split.pt*
    bash "$mpirun_sh" 2 "$gpipe" "${script[@]}" --steps 3 --save "$work/split.pt" --per-stage-files >/dev/null 2>&1
    cp "$work/split.pt.stage1-of-2" "$work/stage1-at-3"
    bash "$mpirun_sh" 2 "$gpipe" "${script[@]}" --steps 5 --resume "$work/split.pt" --save "$work/split.pt" \
      --per-stage-files >/dev/null 2>&1
    cp "$work/stage1-at-3" "$work/split.pt.stage1-of-2"
    if ! bash "$mpirun_sh" 2 "$gpipe" "${script[@]}" --resume "$work/split.pt" --per-stage-files \
         >/dev/null 2>"$work/err.txt" &&
       grep -q "split.pt.manifest names step 5, but .*split.pt.stage1-of-2 is of step 3" "$work/err.txt"; then
      pass "stage files of another step than the manifest's are refused: $(grep -o 'names step.*' "$work/err.txt" | head -1 | cut -c1-100)"
    else fail "mixed per-stage files"; cat "$work/err.txt"; fi
  fi
fi

if part script_kill; then  # cost 38
  if make_script; then
    # A rank killed while the per-stage files are written (saved after every step): the set on disk
    # resumes to the unbroken parameters.
    for trial in 1 2; do
      rm -f "$work"/split.pt*
      rm -f "$work/err.txt"  # the new run's lines only: wait_for reads it at once
      bash "$mpirun_sh" 2 "$gpipe" "${script[@]}" --save "$work/split.pt" --per-stage-files --save-every 1 \
        >/dev/null 2>"$work/err.txt" &
      pid=$!
      pids+=("$pid")
      step=$((RANDOM % 12 + 1))
      if ! wait_for "$work/err.txt" "epoch 2/20 step $step/12" "$pid"; then fail "per-stage SIGKILL: no step line"; continue; fi
      victim_pid=$(rank_pid "$pid" $((trial % 2)))
      if [ -z "$victim_pid" ]; then fail "per-stage: rank $((trial % 2)) not found"; wait "$pid"; continue; fi
      kill -9 "$victim_pid"
      wait_bounded "$pid" 240
      if [ $? = 124 ]; then fail "per-stage: the job still ran 240 s after its rank was killed: hung"; continue; fi
      if bash "$mpirun_sh" 2 "$gpipe" "${script[@]}" --resume "$work/split.pt" --per-stage-files \
           >"$work/s-resumed.json" 2>"$work/err.txt" && [ "$(checksum "$work/s-resumed.json")" = "$s_unbroken" ]; then
        pass "rank $((trial % 2)) killed while saving per-stage files every step: the set on disk resumes to unbroken"
      else fail "per-stage files after a killed rank"; tail -5 "$work/err.txt"; ls "$work"; fi
    done
  fi
fi

parts_end || failures=$((failures + 1))
echo "$failures failure(s)"
[ "$failures" -eq 0 ]
