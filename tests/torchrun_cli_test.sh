#!/usr/bin/env bash
# torchrun_cli_test.sh: `gpipe train` and a Python script under torchrun, one device per process over
# c10d: the parameters of one process, bit for bit; a rank that fails, or is killed (SIGKILL), ends
# the job with its message, and no process is left; a rank started alone says that it waits.
# Usage: [GPIPE_TEST_PART=PART] torchrun_cli_test.sh PATH/TO/gpipe PYTHONPATH   (parts: tests/parts_lib.sh)
set -u
gpipe="$1"
python_path="$2"
source "$(dirname "$0")/test_lib.sh"
torchrun_sh="$tests_dir/torchrun.sh"
small=(--train-samples 1024 --test-samples 200 --epochs 1 --steps 6 --json)
checksum() { /usr/bin/python3 -c 'import json,sys; print(repr(json.load(open(sys.argv[1]))["parameter_checksum"]))' "$1"; }
source "$tests_dir/parts_lib.sh"

if part train; then  # cost 25
  for args in "--stages 2 --schedule task" "--stages 2 --schedule zbv --micro-batches 4"; do
    if "$gpipe" train "${small[@]}" $args >"$work/one.json" 2>/dev/null &&
       timeout -k 10 240 bash "$torchrun_sh" 2 "$gpipe" train "${small[@]}" $args >"$work/c10d.json" 2>"$work/c10d.err"; then
      a=$(checksum "$work/one.json"); b=$(checksum "$work/c10d.json")
      if [ "$a" = "$b" ]; then pass "torchrun 2 $args: parameters equal one process ($a)"
      else fail "torchrun 2 $args: checksum $b, one process $a"; fi
    else fail "torchrun 2 $args exited non-zero"; tail -5 "$work/c10d.err"; fi
  done
  # A stage that fails on rank 1 at its third step: the job ends with that rank's message, no process left.
  begin=$SECONDS
  GPIPE_TEST_FAULT=exit:1:3 timeout -k 10 240 bash "$torchrun_sh" 2 "$gpipe" train "${small[@]}" --stages 2 \
    --save "$work/fault.pt" >"$work/fault.out" 2>&1
  status=$?
  # This job's processes carry its file's path (other tests run gpipe at the same time).
  if [ "$status" = 0 ] || [ "$status" = 124 ]; then fail "a failing rank under torchrun: exit $status"; tail -5 "$work/fault.out"
  elif pgrep -f "$work/fault.pt" >/dev/null; then fail "a failing rank: a process was left"; pgrep -af "$work/fault.pt"
  else pass "a failing rank ends the job under torchrun (exit $status, $((SECONDS - begin)) s)"; fi
fi

if part python; then  # cost 15
  cat >"$work/train.py" <<'PY'
import sys, torch, gpipe
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                            torch.nn.Linear(16, 4))
pipe = gpipe.GPipe(model, devices=2, chunks=4, balance=[2, 3])
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(3):
    x, y = torch.randn(16, 12), torch.randn(16, 4)
    opt.zero_grad()
    loss = pipe.train_step(x, y, loss="mse")
    opt.step()
if pipe.rank == 0:
    print(repr(float(loss)), pipe.describe())
PY
  one=$(PYTHONPATH="$python_path" /usr/bin/python3 "$work/train.py" | cut -d' ' -f1)
  out=$(PYTHONPATH="$python_path" timeout -k 10 240 bash "$torchrun_sh" 2 /usr/bin/python3 "$work/train.py" 2>/dev/null)
  if [[ "$out" == "$one c10d (Gloo; shared memory with 1 of 1 other rank): 2 ranks"* ]]; then pass "gpipe.GPipe under torchrun: the loss of one process ($one)"
  else fail "gpipe.GPipe under torchrun printed \"$out\", one process \"$one\""; fi
fi

# The pid of RANK's process among those whose command line holds `marker` (a path of this test's own).
rank_pid() {  # MARKER RANK
  local p
  for p in $(pgrep -f "$1"); do
    if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "RANK=$2"; then echo "$p"; return; fi
  done
}

# kill_rank1 MARKER FILE LINE: waits until FILE (the job's standard error) has LINE, kills rank 1 with
# SIGKILL, then waits for the job ($job, a background torchrun) to end: 60 s at most. Sets $status
# and $took (seconds from the kill to the end).
kill_rank1() {
  local deadline=$((SECONDS + 120)) victim begin
  until grep -q -- "$3" "$2" 2>/dev/null; do
    if ! kill -0 "$job" 2>/dev/null || [ $SECONDS -gt $deadline ]; then status=none; return; fi
    sleep 0.05
  done
  victim=$(rank_pid "$1" 1)
  [ -n "$victim" ] || { status=none; return; }
  kill -9 "$victim"
  begin=$SECONDS
  if timeout 60 tail --pid="$job" -s 0.1 -f /dev/null; then wait "$job"; status=$?; else status=hung; pkill -9 -f "$1"; kill -9 "$job"; fi
  took=$((SECONDS - begin))
}

if part kill; then  # cost 15
  # A rank killed with SIGKILL: the job ends, naming it, no process is left, and the last file saved
  # (every 3 steps) resumes in one process to the parameters of an unbroken run.
  run=(train --train-samples 640 --test-samples 100 --batch-size 64 --epochs 50 --stages 2 --schedule task)
  bash "$torchrun_sh" 2 "$gpipe" "${run[@]}" --save "$work/kill.pt" --save-every 3 >/dev/null 2>"$work/kill.err" &
  job=$!
  kill_rank1 "$work/kill.pt" "$work/kill.err" "epoch 2/50 step $((RANDOM % 10 + 1))/10"
  if [ "$status" = none ] || [ "$status" = hung ] || [ "$status" = 0 ]; then
    fail "rank 1 killed under torchrun: $status"; tail -5 "$work/kill.err"
  elif pgrep -f "$work/kill.pt" >/dev/null; then fail "rank 1 killed under torchrun: a process was left"; pgrep -af "$work/kill.pt"
  elif ! grep -q "rank *: 1 .*" "$work/kill.err" || ! grep -q "Signal 9 (SIGKILL)" "$work/kill.err"; then
    fail "rank 1 killed under torchrun: no line names it"; tail -12 "$work/kill.err"
  elif "$gpipe" "${run[@]}" --steps 25 --resume "$work/kill.pt" --json >"$work/resumed.json" 2>/dev/null &&
       "$gpipe" "${run[@]}" --steps 25 --json >"$work/unbroken.json" 2>/dev/null &&
       [ "$(checksum "$work/resumed.json")" = "$(checksum "$work/unbroken.json")" ]; then
    pass "rank 1 killed under torchrun: the job ended in $took s (exit $status), naming it, no process left; the file resumes to unbroken"
  else fail "rank 1 killed under torchrun: the file left does not resume to unbroken"; fi
fi

if part agent_kill; then  # cost 15
  # torchrun's agent killed with SIGKILL: its ranks stop at a step boundary within seconds, each file
  # whole, no process left, and rank 0 prints a resume command with the flags Debian's torchrun needs.
  run=(train --train-samples 640 --test-samples 100 --batch-size 64 --epochs 50 --stages 2 --schedule task)
  port=$(/usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  mkdir -p "$work/logs"
  /usr/bin/python3 -m torch.distributed.run --redirects 2 --tee 2 --log_dir "$work/logs" --nproc_per_node 2 \
    --master_addr 127.0.0.1 --master_port "$port" --no_python "$gpipe" "${run[@]}" --save "$work/agent.pt" \
    >/dev/null 2>"$work/agent.err" &
  agent=$!
  deadline=$((SECONDS + 120))
  until grep -q "epoch 2/50" "$work/agent.err" 2>/dev/null || ! kill -0 "$agent" 2>/dev/null || [ $SECONDS -gt $deadline ]; do
    sleep 0.05
  done
  kill -9 "$agent"
  begin=$SECONDS
  until ! pgrep -f "$work/agent.pt" >/dev/null || [ $((SECONDS - begin)) -gt 30 ]; do sleep 0.1; done
  took=$((SECONDS - begin))
  rank0_err=$(find "$work/logs" -path '*/0/stderr.log' | head -n 1)
  if pgrep -f "$work/agent.pt" >/dev/null; then
    fail "torchrun's agent killed: ranks still run after 30 s"; pgrep -af "$work/agent.pt"; pkill -9 -f "$work/agent.pt"
  elif [ $took -gt 15 ]; then fail "torchrun's agent killed: the ranks took $took s to stop"
  # (A busy machine may deliver a second SIGTERM before the step boundary, which ends the run at once with
  # the last save whole, as documented: then there is no resume line to check, and the file must resume.)
  elif ! grep -q "a second signal (ended at once); the last save is whole" "$rank0_err" &&
       ! grep -q -- "--redirects 2 --tee 2 --log_dir $work/logs .*--resume $work/agent.pt" "$rank0_err"; then
    fail "torchrun's agent killed: rank 0's resume command"; tail -5 "$rank0_err"
  elif "$gpipe" "${run[@]}" --steps 25 --resume "$work/agent.pt" --json >/dev/null 2>"$work/resumed.err"; then
    pass "torchrun's agent killed: its ranks stopped in $took s with a whole file and a resume command that starts"
  else fail "torchrun's agent killed: the file left does not resume"; cat "$work/resumed.err"; fi
fi

if part python_kill; then  # cost 12
  # The same for a Python script: the job ends, no process is left.
  cat >"$work/loop.py" <<'PY'
import sys, torch, gpipe
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
pipe = gpipe.GPipe(model, devices=2, chunks=4, balance=[2, 1])
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(100000):
    x, y = torch.randn(16, 12), torch.randn(16, 4)
    opt.zero_grad()
    pipe.train_step(x, y, loss="mse")
    opt.step()
    if step == 20 and pipe.rank == 0:
        print("step 20", file=sys.stderr, flush=True)
PY
  PYTHONPATH="$python_path" bash "$torchrun_sh" 2 /usr/bin/python3 "$work/loop.py" >/dev/null 2>"$work/py.err" &
  job=$!
  kill_rank1 "$work/loop.py" "$work/py.err" "step 20"
  if [ "$status" = none ] || [ "$status" = hung ] || [ "$status" = 0 ]; then
    fail "a Python rank killed under torchrun: $status"; tail -5 "$work/py.err"
  elif pgrep -f "$work/loop.py" >/dev/null; then fail "a Python rank killed: a process was left"; pgrep -af "$work/loop.py"
  else pass "a Python rank killed under torchrun: the job ended in $took s (exit $status), no process left"; fi
fi

if part busy_peer; then  # cost 30
  # A rank alive but busy elsewhere between its calls: the rank waiting for it says so after 10 s,
  # naming it and the timeout, and the job goes on when it comes.
  cat >"$work/busy.py" <<'PY'
import sys, time, torch, gpipe
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
pipe = gpipe.GPipe(model, devices=2, chunks=4)  # built on the first batch; its rank known before
assert pipe.rank == int(sys.argv[1] if len(sys.argv) > 1 else __import__("os").environ["RANK"]), pipe.rank
for step in range(2):
    if step == 1 and pipe.rank == 1:
        time.sleep(11)  # busy with something else: no pipeline call for 11 s
    pipe.train_step(torch.randn(16, 12), torch.randn(16, 4), loss="mse")
print("done", file=sys.stderr)
PY
  if PYTHONPATH="$python_path" timeout -k 10 120 bash "$torchrun_sh" 2 /usr/bin/python3 "$work/busy.py" >/dev/null 2>"$work/busy.err" &&
     grep -q "rank 0 has waited 10 s for rank 1 in a pipeline call; it waits 1800 s at most (GPIPE_TIMEOUT)" "$work/busy.err"; then
    pass "a rank busy elsewhere for 11 s: the one waiting for it says so at 10 s, and the job goes on"
  else fail "a rank busy elsewhere: $(tail -5 "$work/busy.err")"; fi
  # Busy for longer than GPIPE_TIMEOUT: the waiting rank's own error names the wait and the peer that
  # made no call, rather than a failure of that rank.
  if PYTHONPATH="$python_path" GPIPE_TIMEOUT=5 timeout -k 10 120 bash "$torchrun_sh" 2 /usr/bin/python3 "$work/busy.py" \
       >/dev/null 2>"$work/late.err"; then
    fail "a rank busy beyond GPIPE_TIMEOUT: the job did not fail"
  elif grep -q "rank 0 waited 5 s (GPIPE_TIMEOUT) for rank 1, whose process is alive but made no pipeline call" "$work/late.err" &&
       ! grep -q "because rank 1 failed" "$work/late.err"; then
    pass "a rank busy beyond GPIPE_TIMEOUT (5 s): the waiting rank says it waited 5 s for a rank that made no call"
  else fail "a rank busy beyond GPIPE_TIMEOUT: $(grep -m3 "gpipe" "$work/late.err")"; fi
fi

if part small_shm; then  # cost 20
  # A /dev/shm too small for the rings (a container's 1 MiB): each rank says so with the room it needed
  # and the reason, the ranks exchange through Gloo, and --json names the transport.
  if ! unshare -m true 2>/dev/null; then
    echo "skipped: no mount namespace to give /dev/shm 1 MiB in (unshare -m)"
  elif unshare -m bash -c 'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$@"' _ timeout -k 10 240 \
         bash "$torchrun_sh" 2 "$gpipe" train "${small[@]}" --stages 2 --schedule task >"$work/shm.json" 2>"$work/shm.err" &&
       grep -q "rank 0 could not make its shared-memory ring to rank 1 in /dev/shm (No space left on device; each needs 8 MiB" "$work/shm.err" &&
       /usr/bin/python3 -c 'import json, sys; t = json.load(open(sys.argv[1]))["transport"]; assert t.startswith("c10d (Gloo") and "shared memory" not in t, t' "$work/shm.json"
  then pass "/dev/shm of 1 MiB: said on standard error with the room needed; --json names Gloo as the transport"
  else fail "/dev/shm of 1 MiB: $(grep -m3 "gpipe\|Error" "$work/shm.err")"; fi
  # GPIPE_BIND_CORES as GPIPE_SHM: a value it does not take is refused naming the choices, not ignored.
  if GPIPE_BIND_CORES=yes timeout -k 10 120 bash "$torchrun_sh" 2 "$gpipe" train "${small[@]}" --stages 2 \
       --schedule task >/dev/null 2>"$work/bind.err"; then
    fail "GPIPE_BIND_CORES=yes was taken"
  elif grep -q "GPIPE_BIND_CORES=yes is not one of 0, 1" "$work/bind.err"; then
    pass "GPIPE_BIND_CORES=yes: refused naming 0 and 1"
  else fail "GPIPE_BIND_CORES=yes: $(grep -m3 "gpipe" "$work/bind.err")"; fi
fi

if part lone; then  # cost 20
  # A rank started without the others (RANK and WORLD_SIZE set by hand) says it waits, how many came
  # and for how long at most, then ends with the fix.
  port=$(/usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port GPIPE_TIMEOUT=14 timeout 60 "$gpipe" train --epochs 1 \
    >/dev/null 2>"$work/lone.err"
  status=$?
  if [ "$status" != 0 ] && [ "$status" != 124 ] &&
     grep -q "gpipe: rank 0 has waited 10 s for the job's other ranks to connect (1 here, 2 in all); it waits 14 s at most (GPIPE_TIMEOUT)" "$work/lone.err" &&
     grep -q "could not connect to the job's other ranks within 14 s (GPIPE_TIMEOUT).*check that every rank was started" "$work/lone.err"; then
    pass "a lone rank says it waits, then ends (exit $status): $(head -c 150 "$work/lone.err")"
  else fail "a lone rank (exit $status): $(cat "$work/lone.err")"; fi
  # Some of env://'s variables, one of them empty: a warning, and the process runs alone.
  if RANK= WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout 60 "$gpipe" train --train-samples 64 \
       --test-samples 16 --steps 1 >/dev/null 2>"$work/some.err" &&
     grep -q "some of RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set, not all: this process runs alone" "$work/some.err"
  then pass "RANK empty, the other three set: a warning, and the process runs alone"
  else fail "RANK empty: $(cat "$work/some.err")"; fi
fi

parts_end || failures=$((failures + 1))
finish
