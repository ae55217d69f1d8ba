#!/usr/bin/env bash
# torchrun_cli_test.sh: `gpipe train` and a Python script under torchrun, one device per process over
# c10d: the parameters of one process, bit for bit; a rank that fails ends the job with its message,
# and no process is left.
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
  for args in "--stages 2" "--stages 2 --schedule zbv --micro-batches 4"; do
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
opt = torch.optim.SGD(pipe.parameters(), lr=0.05)
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
  if [[ "$out" == "$one c10d (Gloo): 2 ranks"* ]]; then pass "gpipe.GPipe under torchrun: the loss of one process ($one)"
  else fail "gpipe.GPipe under torchrun printed \"$out\", one process \"$one\""; fi
fi

parts_end || failures=$((failures + 1))
finish
