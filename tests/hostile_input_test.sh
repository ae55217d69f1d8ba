#!/usr/bin/env bash
# hostile_input_test.sh: what careless and hostile users did to `gpipe train`, case by case: each
# ends with a clear error (or a clear stop) and a non-zero exit, never a hang, a silent change of
# the data or the model, or a lost file. The numbers are the cases of the hardening work, in order
# of severity. Cases that need models or data from Python are skipped without python3-torch.
# Usage: [GPIPE_TEST_PART=PART] hostile_input_test.sh PATH/TO/gpipe [PATH/TO/largest_model]
# (parts: tests/parts_lib.sh)
set -u
gpipe="$1"
largest_model="${2:-}"
python=/usr/bin/python3
source "$(dirname "$0")/test_lib.sh"
tiny=(--train-samples 256 --test-samples 64 --batch-size 64)
source "$tests_dir/parts_lib.sh"
# A command that runs longer than this hangs (the longest here take a few seconds on a quiet machine;
# the margin is for a loaded one).
hang=240

# run NAME STATUS PATTERN ARGS...: `gpipe ARGS` exits with STATUS (not hung) and its standard
# error matches PATTERN (grep -E); no epoch was reported unless STATUS is 0.
run() {
  local name="$1" status="$2" pattern="$3"
  shift 3
  timeout "$hang" "$gpipe" "$@" >"$work/out.txt" 2>"$work/err.txt"
  local got=$?
  if [ "$got" -ne "$status" ]; then fail "$name: exit $got, not $status: $(head -c 300 "$work/err.txt")"; return 1; fi
  if ! grep -Eq -- "$pattern" "$work/err.txt"; then fail "$name: no /$pattern/ in: $(head -c 400 "$work/err.txt")"; return 1; fi
  if [ "$status" -ne 0 ] && grep -q "^epoch" "$work/out.txt"; then fail "$name: trained before the error"; return 1; fi
  if grep -q "frame #\|Exception raised from" "$work/err.txt"; then fail "$name: libtorch's C++ stack shown"; return 1; fi
  pass "$name: $(grep -E -m1 -- "$pattern" "$work/err.txt" | head -c 160)"
}

# make_models: the models and data of the cases that need them, saved from Python (torch=1), or the
# reason those cases are skipped. Each part that has such cases calls it first.
torch=0
make_models() {
  if "$python" - "$work" >"$work/python.err" 2>&1 <<'PY'
import sys
import torch
work = sys.argv[1]
source = f"{work}/models.py"
open(source, "w").write('''
import torch
class Doubled(torch.nn.Module):  # children a and b, but a forward of its own
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)
    def forward(self, x):
        return self.b(torch.relu(self.a(x))) * 2
class Picky(torch.nn.Module):  # fails on micro-batches of 3 rows only
    def forward(self, x):
        if x.size(0) == 3:
            return x.view(-1, 7)
        return x
class FourRows(torch.nn.Module):  # needs at least 4 rows
    def forward(self, x):
        if x.size(0) < 4:
            raise RuntimeError("FourRows needs at least 4 rows")
        return x
class First(torch.nn.Module):  # keeps the first row only
    def forward(self, x):
        return x[:1]
class Argmax(torch.nn.Module):  # the index of the largest score, as floats: no gradient
    def forward(self, x):
        return torch.argmax(x, dim=1, keepdim=True).float().expand(-1, 3).contiguous()
class Pair(torch.nn.Module):  # returns a tuple
    def forward(self, x):
        return (x, x)
class IntPair(torch.nn.Module):  # returns a tuple holding an int
    def forward(self, x):
        return (x, 3)
class Named(torch.nn.Module):  # returns a dict
    def forward(self, x):
        return {"x": x}
class AddOne(torch.nn.Module):  # changes its input in place
    def forward(self, x):
        return x.add_(1.0)
class AddOneWithAGraph(torch.nn.Module):  # changes its input in place only where it takes a gradient
    def forward(self, x):
        if x.requires_grad:
            x.add_(1.0)
        return x
''')
sys.path.insert(0, work)
import models
torch.manual_seed(0)
torch.jit.script(models.Doubled()).save(f"{work}/doubled.pt")
linear = lambda: torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
torch.jit.script(linear()).save(f"{work}/model.pt")
diverged = linear()
with torch.no_grad():
    diverged[0].weight[0, 0] = float("nan")
torch.jit.script(diverged).save(f"{work}/nan-weight.pt")
torch.jit.script(torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(8, 3))).save(
    f"{work}/mismatched.pt")
torch.jit.script(torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), models.Picky(),
                                     torch.nn.Linear(8, 3))).save(f"{work}/picky.pt")
torch.jit.script(torch.nn.Sequential(torch.nn.Linear(6, 8), models.FourRows(), torch.nn.Linear(8, 3))).save(
    f"{work}/four-rows.pt")
torch.jit.script(torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), models.First(),
                                     torch.nn.Linear(8, 3))).save(f"{work}/first-row.pt")
torch.jit.script(torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3),
                                     models.Argmax())).save(f"{work}/argmax.pt")
torch.jit.script(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Tanh())).save(f"{work}/no-parameters.pt")
torch.jit.script(torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                     torch.nn.Linear(8, 3))).save(f"{work}/batch-norm.pt")
shared = torch.nn.Linear(6, 6)  # one module at two places: its weight tied, with two names
torch.jit.script(torch.nn.Sequential(shared, torch.nn.Tanh(), shared, torch.nn.Tanh(),
                                     torch.nn.Linear(6, 3))).save(f"{work}/tied.pt")
x = torch.randn(40, 6)
save = lambda name, **d: torch.save(d, f"{work}/{name}.pt")
save("data", input=x, target=torch.randn(40, 3))
save("classes", input=x, target=torch.randint(0, 3, (40,)))
save("class-9", input=x, target=torch.full((40,), 9))
save("classes-n1", input=x, target=torch.randint(0, 3, (40, 1)))
save("target-n", input=x, target=torch.randn(40))
save("target-n1", input=x, target=torch.randn(40, 1))
nan = x.clone()
nan[7, 2] = float("nan")
save("nan", input=nan, target=torch.randn(40, 3))
save("huge", input=x * 1e30, target=torch.randn(40, 3))
save("no-target", input=x)
save("typo", input=x, targets=torch.randn(40, 3))
save("empty", input=x[:0], target=torch.randn(0, 3))
torch.jit.script(torch.nn.Sequential(torch.nn.Linear(6, 6), models.Pair())).save(f"{work}/tuple.pt")
torch.jit.script(torch.nn.Sequential(torch.nn.Linear(6, 6), models.IntPair())).save(f"{work}/int-tuple.pt")
torch.jit.script(torch.nn.Sequential(torch.nn.Linear(6, 6), models.Named())).save(f"{work}/dict.pt")
torch.jit.script(torch.nn.Sequential(torch.nn.Linear(6, 3))).save(f"{work}/one-layer.pt")
torch.jit.script(torch.nn.Sequential(torch.nn.Linear(6, 8), models.First(), torch.nn.Linear(8, 3))).save(f"{work}/rows.pt")
torch.jit.script(linear().double()).save(f"{work}/model64.pt")
torch.jit.script(torch.nn.Sequential(torch.nn.Linear(6, 8), models.AddOne(), torch.nn.ReLU(),
                                     torch.nn.Linear(8, 3))).save(f"{work}/in-place.pt")
torch.jit.script(torch.nn.Sequential(torch.nn.Linear(6, 8), models.AddOneWithAGraph(), torch.nn.ReLU(),
                                     torch.nn.Linear(8, 3))).save(f"{work}/graph-in-place.pt")
save("target64", input=x, target=torch.randn(40, 3).double())
save("input64", input=x.double(), target=torch.randn(40, 3))
save("input-u8", input=(x * 10).to(torch.uint8), target=torch.randn(40, 3))
torch.save({"input": x, "target": torch.randn(40, 3)}, f"{work}/old-format.pt", _use_new_zipfile_serialization=False)
save("sparse", input=x.to_sparse(), target=torch.randn(40, 3))
save("overflow", input=x * 1e20, target=torch.randn(40, 3))
torch.save([x, torch.randn(40, 3)], f"{work}/list.pt")
torch.jit.script(torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 3))).save(f"{work}/embedding.pt")
PY
  then torch=1
  else echo "skipped: the cases with models and data from Python (no python3-torch: $(tail -1 "$work/python.err"))"
  fi
}

# make_checkpoint: $work/ckpt.pt, the CNN's checkpoint file at step 2.
make_checkpoint() {
  "$gpipe" train "${tiny[@]}" --steps 2 --save "$work/ckpt.pt" >/dev/null 2>&1
}
model=(--model "$work/model.pt" --loss mse)  # with a --data of each case's own

if part resume_loop; then  # cost 20
  # 1. A refused --resume returns through normal unwinding, every time: 9 runs, none hangs.
  make_checkpoint
  head -c 20000 "$work/ckpt.pt" >"$work/truncated.pt"
  hung=0 wrong=0
  for i in $(seq 1 9); do
    case $((i % 3)) in
      0) args=(--resume "$work/ckpt.pt" --optimizer sgd) ;;
      1) args=(--resume "$work/truncated.pt") ;;
      2) args=(--resume "$work/ckpt.pt" --stages 3) ;;  # another K is fine: this one must run
    esac
    timeout "$hang" "$gpipe" train "${tiny[@]}" --steps 3 "${args[@]}" >/dev/null 2>"$work/err.txt"
    status=$?
    if [ "$status" -eq 124 ]; then hung=$((hung + 1))
    elif { [ $((i % 3)) -ne 2 ] && [ "$status" -ne 2 ]; } || { [ $((i % 3)) -eq 2 ] && [ "$status" -ne 0 ]; }; then
      wrong=$((wrong + 1)); cat "$work/err.txt"
    fi
  done
  if [ "$hung" -eq 0 ] && [ "$wrong" -eq 0 ]; then pass "1. 9 refused or accepted --resume runs: none hung"
  else fail "1. --resume: $hung of 9 runs hung, $wrong ended wrongly"; fi
fi

if part targets; then  # cost 10
  make_models
  if [ "$torch" = 1 ]; then
    # 2. A module that is not an nn.Sequential is not cut into its children.
    run "2. a module with its own forward" 2 "holds __torch__\.(models\.)?Doubled, not a torch\.nn\.Sequential" \
      train --model "$work/doubled.pt" --data "$work/data.pt" --loss mse

    # 3. Targets that do not fit the loss and the model's output: both shapes named.
    run "3. cross_entropy targets [N, 1]" 2 "outputs \[2, 3\].*shape \[40, 1\]; squeeze" \
      train --model "$work/model.pt" --data "$work/classes-n1.pt" --loss cross_entropy
    run "3. mse targets [N] against outputs [N, 3]" 2 "outputs rows of shape \[3\], but the targets' rows have shape \[\]" \
      train "${model[@]}" --data "$work/target-n.pt"
    run "3. mse targets [N, 1] against outputs [N, 3]" 2 "rows of shape \[3\].*shape \[1\] \(targets \[40, 1\]\)" \
      train "${model[@]}" --data "$work/target-n1.pt"
    run "3. class indices with --loss mse" 2 "--loss mse needs real-valued targets" \
      train "${model[@]}" --data "$work/classes.pt"
    run "3. classes the model does not output" 2 "the targets hold class 9, but the model outputs 3 classes" \
      train --model "$work/model.pt" --data "$work/class-9.pt" --loss cross_entropy
    # A parameter that holds NaN: named before any step, not blamed on the data or --lr.
    run "3. a model whose weight holds NaN" 2 "the model's parameter 0.weight holds NaN or infinite values" \
      train --model "$work/nan-weight.pt" --data "$work/data.pt" --loss mse
    # A layer that needs 4 rows is not refused for the check's two samples: micro-batches of 10 rows train.
    run "3. a layer that needs 4 rows, micro-batches of 10" 0 "" \
      train --model "$work/four-rows.pt" --data "$work/data.pt" --loss mse --batch-size 20 --micro-batches 2 \
      --schedule gpipe --steps 2
  fi
fi

if part nonfinite; then  # cost 12
  make_models
  # 4. Non-finite values: flags and data refused up front; a loss that becomes non-finite stops the
  # run before the update and never replaces a good checkpoint.
  run "4. --lr inf" 2 "--lr: must be a finite number above 0 \(got inf\)" train "${tiny[@]}" --lr inf
  run "4. --lr nan" 2 "--lr: must be a finite number above 0" train "${tiny[@]}" --lr nan
  run "4. --clip-grad-norm inf" 2 "--clip-grad-norm" train "${tiny[@]}" --clip-grad-norm inf
  if [ "$torch" = 1 ]; then
    run "4. NaN in the data" 2 "'input' holds NaN or infinite values in 1 rows, the first at row 7" \
      train "${model[@]}" --data "$work/nan.pt"
    "$gpipe" train "${model[@]}" --data "$work/data.pt" --steps 2 --save "$work/good.pt" >/dev/null 2>&1
    cp "$work/good.pt" "$work/good.keep"
    run "4. the loss becomes infinite" 1 "the loss became (infinite|NaN) in step 3 .*the last checkpoint file \(step 2\) is kept" \
      train "${model[@]}" --data "$work/huge.pt" --steps 6 --resume "$work/good.pt" --save "$work/good.pt"
    if [ -s "$work/good.keep" ] && cmp -s "$work/good.pt" "$work/good.keep"; then pass "4. the good checkpoint is unchanged"
    else fail "4. the checkpoint was replaced"; fi
  fi

  # Refused before any step, where the schedule starts or ends beyond float's range.
  run "4. a learning rate beyond float's range" 2 "the learning rate of the last step, 2, would be 1e\+39, beyond float's range .*lower --lr$" \
    train "${tiny[@]}" --steps 2 --optimizer sgd --lr 1e39
  run "4. a step schedule that grows beyond float's range" 2 "the learning rate of the last step, 4, would be inf, beyond float's range .*lower --lr, --lr-gamma or the steps" \
    train "${tiny[@]}" --steps 4 --lr-schedule step --lr-gamma 1e300 --lr-step-size 1
fi

if part outputs; then  # cost 23
  make_models
  make_checkpoint
  # 5. What the machine cannot run is refused at once.
  run "5. --threads-per-stage 1000" 2 "--threads-per-stage 1000 is more than this machine's [0-9]+ cores" \
    train "${tiny[@]}" --threads-per-stage 1000

  # 6. Outputs checked before training, with the OS's reason; a failed trace keeps the summary; a
  # failed write to standard output is an error.
  run "6. --save into a missing folder" 2 "--save: cannot write $work/no/such/dir/x.pt: $work/no/such/dir does not exist; give a path in a folder that exists \(mkdir -p" \
    train "${tiny[@]}" --save "$work/no/such/dir/x.pt"
  run "6. --trace into a missing folder" 2 "--trace: cannot write .*: .* does not exist; give a path in a folder that exists" \
    train "${tiny[@]}" --trace "$work/no/such/dir/t.json"
  touch "$work/plain"
  run "6. --save under a file" 2 "--save: cannot write $work/plain/x.pt: $work/plain is not a folder" \
    train "${tiny[@]}" --save "$work/plain/x.pt"
  if [ "$(id -u)" -ne 0 ]; then
    mkdir "$work/locked" && chmod 500 "$work/locked"
    run "6. --save into a read-only folder" 2 "Permission denied" train "${tiny[@]}" --save "$work/locked/x.pt"
  fi
  if [ -c /dev/full ] && [ -w /dev/full ]; then
    timeout "$hang" "$gpipe" train "${tiny[@]}" --steps 2 --json --trace /dev/full >"$work/out.txt" 2>"$work/err.txt"
    status=$?
    if [ "$status" -eq 1 ] && grep -q "No space left on device" "$work/err.txt" &&
       "$python" -c 'import json,sys; assert json.load(open(sys.argv[1]))["steps"] == 2' "$work/out.txt"; then
      pass "6. --trace /dev/full: exit 1, 'No space left on device', the JSON summary kept"
    else fail "6. --trace /dev/full: exit $status: $(cat "$work/err.txt")"; fi
    [ -c /dev/full ] || fail "6. --trace /dev/full replaced the device with a file (restore it: mknod -m 666 /dev/full c 1 7)"
    timeout "$hang" "$gpipe" train "${tiny[@]}" --steps 2 >/dev/full 2>"$work/err.txt"
    status=$?
    if [ "$status" -ne 0 ] && grep -q "cannot write to standard output" "$work/err.txt"; then
      pass "6. standard output on /dev/full: exit $status, said so"
    else fail "6. standard output on /dev/full: exit $status: $(cat "$work/err.txt")"; fi
  fi

  run "6. --save onto the training data" 2 "--save .*data.pt is the file of --data; writing it would replace your input" \
    train --model "$work/model.pt" --data "$work/data.pt" --loss mse --save "$work/data.pt"
  run "6. --save and --trace one file" 2 "--save .*same.json is the file of --trace" \
    train "${tiny[@]}" --save "$work/same.json" --trace "$work/same.json"
  run "6. --trace with --epochs 0" 2 "--epochs 0 trains nothing, so there is no step for --trace to draw" \
    train "${tiny[@]}" --resume "$work/ckpt.pt" --epochs 0 --trace "$work/none.json"
  run "6. --train-samples for a workload" 2 "--model tiny trains on its own random batch: --train-samples, --test-samples and --data-dir" \
    train --model tiny --train-samples 64 --steps 1
  run "6. --data-dir with --data" 2 "--data-dir is the folder of a built-in data set, which --data .* replaces" \
    train --model "$work/model.pt" --data "$work/data.pt" --loss mse --data-dir /nonexistent
  run "6. --trace onto the checkpoint resumed" 2 "--trace .*ckpt.pt is the file of --resume; writing it would replace your input" \
    train "${tiny[@]}" --steps 4 --resume "$work/ckpt.pt" --trace "$work/ckpt.pt"
  mkdir -p "$work/fm" && cp /usr/share/datasets/fashion-mnist/* "$work/fm/" 2>/dev/null
  if [ -f "$work/fm/t10k-images-idx3-ubyte.gz" ]; then
    run "6. --save onto a file of --data-dir" 2 "--save .*t10k-images-idx3-ubyte.gz is a file of --data-dir .*, the data set's folder" \
      train "${tiny[@]}" --data-dir "$work/fm" --save "$work/fm/t10k-images-idx3-ubyte.gz"
  fi
  # A checkpoint with 16 bytes overwritten in its middle: refused by its digest.
  cp "$work/ckpt.pt" "$work/corrupt.pt"
  printf 'XXXXXXXXXXXXXXXX' | dd of="$work/corrupt.pt" bs=1 seek=$(($(stat -c %s "$work/ckpt.pt") / 2)) conv=notrunc 2>/dev/null
  run "6. a corrupted checkpoint" 2 "corrupt.pt is truncated, corrupt or not a gpipe checkpoint file \(its digest does not match" \
    train "${tiny[@]}" --steps 4 --resume "$work/corrupt.pt"
  # The checkpoint read by torch.load and written again by torch.save: the reason, not a missing field.
  if "$python" -c 'import sys, torch; torch.save(torch.load(sys.argv[1]), sys.argv[2])' "$work/ckpt.pt" "$work/resaved.pt"; then
    run "6. a checkpoint written again by torch.save" 2 "resaved.pt holds a gpipe checkpoint written again by another program \(torch.save" \
      train "${tiny[@]}" --steps 4 --resume "$work/resaved.pt"
  else fail "6. torch.load could not read gpipe's checkpoint"; fi
  # Edited in Python and sealed again with gpipe's digest (a plain FNV-1a of the bytes): a parameter of
  # another dtype, one that holds NaN, and a parameter without its optimizer state are each named, at once.
  if "$python" - "$work/ckpt.pt" "$work" <<'PY'
import io, sys, torch
path, work = sys.argv[1], sys.argv[2]
tag = b"gpipe-fnv1a64:"
body = open(path, "rb").read()[:-(len(tag) + 16)]
def seal(data):
    h = 0xcbf29ce484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return data + tag + b"%016x" % h
def edited(name, change):
    d = torch.load(io.BytesIO(body))
    change(d)
    out = io.BytesIO()
    torch.save(d, out)
    open(f"{work}/{name}.pt", "wb").write(seal(out.getvalue()))
def at(d, name):
    return d["parameter_names"].index(name)
def f64(d): d["parameters"][at(d, "0.bias")] = d["parameters"][at(d, "0.bias")].double()
def nan(d): d["parameters"][at(d, "0.bias")][3] = float("nan")
def no_state(d): del d["optimizer_states"]["0.bias"]
edited("f64", f64); edited("nan", nan); edited("no-state", no_state); edited("resealed", lambda d: None)
PY
  then
    run "6. a parameter of another dtype" 2 "f64.pt is corrupt: its parameter 0.bias is Double \(float64\) \[32\], this model's Float \(float32\) \[32\]" \
      train "${tiny[@]}" --steps 4 --resume "$work/f64.pt"
    run "6. a parameter that holds NaN" 2 "nan.pt is corrupt: its parameter 0.bias holds NaN or infinite values" \
      train "${tiny[@]}" --steps 4 --resume "$work/nan.pt"
    run "6. a parameter without its optimizer state" 2 "no-state.pt is corrupt: it has no optimizer state for 0.bias" \
      train "${tiny[@]}" --steps 4 --resume "$work/no-state.pt"
    # Unchanged but written back by Python (its lists untyped): it resumes.
    run "6. a checkpoint written back by Python and sealed again" 0 "" train "${tiny[@]}" --steps 3 --resume "$work/resealed.pt"
  else fail "6. the edited checkpoints could not be made"; fi

  # 7. A resume that runs no step says so; no loss is made up.
  timeout "$hang" "$gpipe" train "${tiny[@]}" --steps 2 --resume "$work/ckpt.pt" --json >"$work/none.json" 2>/dev/null
  timeout "$hang" "$gpipe" train "${tiny[@]}" --steps 2 --resume "$work/ckpt.pt" >"$work/none.txt" 2>/dev/null
  if "$python" -c '
import json, sys
s = json.load(open(sys.argv[1]))
assert s["steps_this_run"] == 0 and s["no_step_ran"] and s["first_loss"] is None and s["final_loss"] is None, s
' "$work/none.json" && grep -q "no step ran: the checkpoint file is at step 2" "$work/none.txt"; then
    pass "7. --resume at --steps: 'no step ran', null losses in JSON"
  else fail "7. --resume at --steps: $(cat "$work/none.txt")"; fi
  timeout "$hang" "$gpipe" train "${tiny[@]}" --steps 2 --resume "$work/ckpt.pt" --save "$work/copy.pt" >"$work/none.txt" 2>&1
  if grep -q "saved to *$work/copy.pt" "$work/none.txt" && [ -s "$work/copy.pt" ]; then
    pass "7. no step ran, another --save: the file it names is written"
  else fail "7. --save after no step: $(ls "$work")"; fi
fi

if part internals; then  # cost 19
  make_models
  if [ "$torch" = 1 ]; then
    # 8. libtorch's and TorchScript's internals only with --verbose.
    run "8. layers that do not fit" 2 "layer 2 fails on the output of layer 1, shape \[2, 16\]: mat1 and mat2 shapes cannot be multiplied \(2x16 and 8x3\)" \
      train --model "$work/mismatched.pt" --data "$work/data.pt" --loss mse
    if grep -q "Traceback of TorchScript" "$work/err.txt"; then fail "8. TorchScript's traceback without --verbose"; fi
    run "8. a stage that fails in training" 1 "stage 1 failed in the forward of micro-batch 0 \(action 1F0, input \[3, 8\]\): shape '\[-1, 7\]' is invalid for input of size 24" \
      train --model "$work/picky.pt" --data "$work/data.pt" --loss mse --stages 2 --batch-size 12 --micro-batches 4
    timeout "$hang" "$gpipe" --verbose train --model "$work/picky.pt" --data "$work/data.pt" --loss mse --stages 2 \
      --batch-size 12 --micro-batches 4 >/dev/null 2>"$work/err.txt"
    if grep -q "Traceback of TorchScript" "$work/err.txt"; then pass "8. --verbose shows TorchScript's traceback"
    else fail "8. --verbose: $(cat "$work/err.txt")"; fi
    head -c 2000 "$work/model.pt" >"$work/broken-model.pt"
    run "8. a broken model file" 2 "broken-model.pt is not a TorchScript module .*: PytorchStreamReader failed" \
      train --model "$work/broken-model.pt" --data "$work/data.pt" --loss mse
    "$gpipe" train --train-samples 64 --test-samples 16 --steps 1 --save "$work/cnn-checkpoint.pt" >/dev/null 2>&1
    run "8. a built-in model's checkpoint as --model" 2 "cnn-checkpoint.pt is a checkpoint file gpipe wrote \(--save\), not a model: resume it with --resume" \
      train --model "$work/cnn-checkpoint.pt" --data "$work/data.pt" --loss mse

    # 9. Messages that name the real problem.
    run "9. a dict of one entry" 2 "no-target.pt holds a dict of one entry" train "${model[@]}" --data "$work/no-target.pt"
    run "9. a dict without 'target'" 2 "typo.pt has no tensor 'target'" train "${model[@]}" --data "$work/typo.pt"
    run "9. no rows" 2 "empty.pt holds no samples" train "${model[@]}" --data "$work/empty.pt"
    run "9. a list, not a dict" 2 "list.pt holds a list of 2 items, not a dict; save it with torch.save\(\{'input': X, 'target': Y\}, path\)" \
      train "${model[@]}" --data "$work/list.pt"
    run "9. a folder as --model" 2 "--model: $work is a folder, not a file" train --model "$work" --data "$work/data.pt" --loss mse
  fi
  run "9. --stages 0" 2 "--stages: must be at least 1 \(got 0\)" train --stages 0
  run "9. --batch-size 0" 2 "--batch-size: must be at least 1 \(got 0\)" train --batch-size 0
  run "9. --stages 1,2" 2 "--stages: must be one whole number, at least 1 \(got 1,2\)" train --stages 1,2
  run "9. a comma list for --balance" 0 "" train "${tiny[@]}" --steps 1 --stages 2 --schedule gpipe --balance 3,8
  run "9. a misspelt command" 2 "unknown command 'trian'; did you mean 'train'\?" trian --steps 1
  if [ "$(grep -c "" "$work/err.txt")" -eq 1 ]; then pass "9. the misspelt command's error is one line"
  else fail "9. misspelt command: $(cat "$work/err.txt")"; fi
fi

if part data; then  # cost 22
  make_models
  # 10. No silent change of the data: seeds out of range refused, the last partial batch kept.
  run "10. --seed -1" 2 "--seed: must be a whole number from 0 to 18446744073709551615 \(got -1\)" train --seed -1
  run "10. --seed 2^64 and more" 2 "\(got 99999999999999999999\)" train --seed 99999999999999999999
  for flags in "" "--drop-last"; do
    timeout "$hang" "$gpipe" train --train-samples 200 --test-samples 64 --batch-size 64 --epochs 2 --json $flags \
      >"$work/epochs.json" 2>/dev/null
    want=$([ -z "$flags" ] && echo 8 || echo 6)  # 200 rows: 64+64+64+8, or the 8 dropped
    if "$python" -c 'import json,sys; s = json.load(open(sys.argv[1])); assert s["steps"] == int(sys.argv[2]), s["steps"]' \
         "$work/epochs.json" "$want"; then pass "10. 200 samples, batches of 64, 2 epochs ${flags:-(default)}: $want steps"
    else fail "10. steps with ${flags:-no flag}"; fi
  done

  # 11. Silently wrong before: a model that cannot train, or whose rows do not pair with the targets,
  # is refused before any step (it trained with exit 0, or with libtorch's resize warnings).
  if [ "$torch" = 1 ]; then
    run "11. a layer that keeps one row (x[:1]) under mse" 2 "layer 2 turns 2 samples \(shape \[2, 8\]\) into 1 row" \
      train --model "$work/first-row.pt" --data "$work/data.pt" --loss mse
    run "11. the same under cross_entropy, before step 1" 2 "layer 2 turns 2 samples .* into 1 row" \
      train --model "$work/first-row.pt" --data "$work/classes.pt" --loss cross_entropy
    run "11. an argmax output" 2 "layer 3 returns a tensor without one \(argmax" \
      train --model "$work/argmax.pt" --data "$work/data.pt" --loss mse
    run "11. a model without parameters" 2 "the model has no parameters: training would change nothing" \
      train --model "$work/no-parameters.pt" --data "$work/data.pt" --loss mse --steps 1
    run "11. gpipe plan of a model that cannot train" 2 "--model .*argmax.pt --input-shape 6: the model's output does not depend on any parameter" \
      plan --model "$work/argmax.pt" --input-shape 6 --devices 2 --batch 8
    # gpipe plan of a model with BatchNorm recommends no one-row micro-batches (gpipe train refuses them).
    if timeout "$hang" "$gpipe" plan --model "$work/batch-norm.pt" --input-shape 6 --devices 2 --batch 8 --json --all \
         >"$work/plan.jsonl" 2>"$work/err.txt" &&
       "$python" - "$work/plan.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
assert rows, "no configuration"
for r in rows:
    assert (8 // r["replicas"]) // r["micro_batches"] >= 2, r
PY
    then pass "11. gpipe plan with BatchNorm: every micro-batch of 2 rows or more"
    else fail "11. gpipe plan with BatchNorm: $(cat "$work/err.txt")"; fi
    # At K=1 (2 replicas of 4 rows) asked for; left to choose K, the plan passes K=1 over and plans K=2.
    run "11. gpipe plan with BatchNorm, M asked for gives one row" 2 "leaves micro-batches of 1 row, but the model needs at least 2" \
      plan --model "$work/batch-norm.pt" --input-shape 6 --devices 2 --stages 1 --batch 8 --micro-batches 4
    if timeout "$hang" "$gpipe" plan --model "$work/batch-norm.pt" --input-shape 6 --devices 2 --batch 8 \
         --micro-batches 4 >"$work/out.txt" 2>"$work/err.txt" &&
       grep -Eq "^ +2 +1 +4 " "$work/out.txt" && ! grep -Eq "^ +1 +2 +4 " "$work/out.txt"; then
      pass "11b. gpipe plan with BatchNorm, K left open: K=2 alone, whose micro-batches have 2 rows"
    else
      fail "11b. gpipe plan with BatchNorm, K left open: not K=2 alone: $(head -c 600 "$work/out.txt" "$work/err.txt")"
    fi

    # A weight tied by a module used twice (the optimizer state is kept under either of its two names):
    # saved at step 3 and resumed to 6, the parameters of 6 unbroken steps.
    tied=(train --model "$work/tied.pt" --data "$work/data.pt" --loss mse --batch-size 8 --stages 2 --schedule task --json)
    if timeout "$hang" "$gpipe" "${tied[@]}" --steps 6 >"$work/tied-unbroken.json" 2>"$work/err.txt" &&
       timeout "$hang" "$gpipe" "${tied[@]}" --steps 3 --save "$work/tied-ckpt.pt" >/dev/null 2>>"$work/err.txt" &&
       timeout "$hang" "$gpipe" "${tied[@]}" --steps 6 --resume "$work/tied-ckpt.pt" >"$work/tied-resumed.json" 2>>"$work/err.txt" &&
       "$python" - "$work/tied-unbroken.json" "$work/tied-resumed.json" <<'PY'
import json, sys
unbroken, resumed = (json.load(open(f)) for f in sys.argv[1:3])
assert resumed["steps_this_run"] == 3, resumed
assert resumed["parameter_checksum"] == unbroken["parameter_checksum"], (resumed["parameter_checksum"], unbroken["parameter_checksum"])
PY
    then pass "11. a tied weight (Adam) saved at step 3 and resumed: equals 6 unbroken steps"
    else fail "11. tied-weight resume: $(tail -3 "$work/err.txt")"; fi
  fi
fi

if part bench_plan; then  # cost 14
  # 12. gpipe bench: a cut given with --balance is labelled as given, and not as one of --balance-by's methods.
  run "12. bench --balance with --balance-by" 2 "--balance \{15, 1\} is the cut, and --balance-by time params even would choose it too" \
    bench --workload tiny --stages 2 --balance 15,1 --balance-by time params even --results ""
  if timeout "$hang" "$gpipe" bench --workload tiny --stages 2 --balance 15,1 --micro-batches 4 --steps 1 --warmup 0 --json \
       --results "" >"$work/bench.jsonl" 2>"$work/err.txt" &&
     "$python" -c 'import json,sys; r = [json.loads(l) for l in open(sys.argv[1])]; assert [x["balance_by"] for x in r] == ["given"], r' \
       "$work/bench.jsonl"; then pass "12. bench --balance 15,1: one row, labelled 'given'"
  else fail "12. bench --balance: $(cat "$work/err.txt")"; fi

  # 12. A value listed twice, more threads than cores, and --transport with sweep flags: refused before any row.
  run "12. bench --stages 2,2" 2 "--stages lists 2 twice; give each value once" \
    bench --workload tiny --stages 2,2 --steps 1 --warmup 0 --results ""
  run "12. bench --schedule gpipe,1f1b,gpipe" 2 "--schedule lists gpipe twice" \
    bench --workload tiny --stages 2 --schedule gpipe,1f1b,gpipe --steps 1 --warmup 0 --results ""
  run "12. bench --threads-per-stage 4096" 2 "--threads-per-stage 4096 is more than this machine's" \
    bench --workload tiny --stages 2 --threads-per-stage 4096 --steps 1 --warmup 0 --results ""
  if [ -s "$work/out.txt" ]; then fail "12. bench --threads-per-stage 4096: printed before the error: $(head -c 200 "$work/out.txt")"; fi
  run "12. bench --transport --stages 4" 2 "--(transport excludes --stages|stages excludes --transport)" bench --transport --stages 4 --results ""

  # 13. Hangs: what would compute for minutes and print hundreds of megabytes is refused at once, with the limit.
  run "13. gpipe plan of 65536 devices and 10^4 layers" 2 "the search would simulate [0-9]+ stage x micro-batch pairs .* more than the 4194304" \
    plan --layers 10000 --width 1024 --heads 16 --ffn 4096 --vocab 32000 --seq 512 --devices 65536 --batch 65536
  run "13. gpipe plan --micro-batches 2,2" 2 "^gpipe: --micro-batches lists 2 twice; give each value once" \
    plan --workload mlp --devices 2 --batch 8 --micro-batches 2,2
  run "13. gpipe plan of 4096 stages x 1024 micro-batches" 2 "narrow it with --stages \(the K to consider\), --micro-batches" \
    plan --layers 4096 --width 64 --heads 4 --ffn 128 --vocab 100 --seq 16 --devices 4096 --batch 1000000 --stages 4096 --micro-batches 1024
  run "13. gpipe schedule at K=2048, M=1024" 2 "2097152 stage x micro-batch pairs; gpipe schedule shows at most 65536" \
    schedule --stages 2048 --micro-batches 1024

  # 14. CLI11's words, and a V too large, said in the flag's terms.
  run "14. three --betas" 2 "--betas: takes 2 values separated by commas \(got 3\); see gpipe train --help" \
    train --betas 0.9,0.99,0.5
  run "14. --stages past an int (CLI11's 'Could not convert')" 2 "--stages: must be a whole number from 1 to 2147483647 \(got 99999999999\)" \
    train --stages 99999999999
  run "14. --speed out of its range" 2 "--speed: must be a number from 1e-06 to 1e\+09 \(got 0\)" \
    plan --workload mlp --devices 2 --batch 8 --speed 0
  run "14. --virtual-stages 16" 2 "cannot cut 11 layers into 2 devices x 16 stages per device \(32 stages\).*with 2 devices use at most 5 stages per device" \
    train --virtual-stages 16

  if [ -n "$largest_model" ]; then  # bench/largest_model's flags: named, with the rule, status 2 (CLI11's 105 before)
    timeout "$hang" "$largest_model" --stages 0 >/dev/null 2>"$work/err.txt"
    status=$?
    if [ "$status" -eq 2 ] && grep -q "largest_model: --stages: must be a whole number from 1 to 64 (got 0)" "$work/err.txt"; then
      pass "14. largest_model --stages 0: exit 2, the flag and its range named"
    else fail "14. largest_model --stages 0: exit $status: $(cat "$work/err.txt")"; fi
  fi
fi

if part late; then  # cost 29
  make_models  # model.pt and data.pt: --model /dev/zero and --data, a link, need the other
  make_checkpoint
  # 15. Late or misleading errors: each refused before any work, naming what is wrong.
  # An output folder that takes no new files (/proc, even for root): found by creating the file up front.
  if [ -d /proc/self ] && ! touch /proc/gpipe-probe 2>/dev/null; then
    run "15. --save into /proc" 2 "--save: cannot write /proc/x.pt: the folder /proc takes no new files" \
      train "${tiny[@]}" --save /proc/x.pt
    run "15. --trace into /proc" 2 "--trace: cannot write /proc/t.json: the folder /proc takes no new files" \
      train "${tiny[@]}" --trace /proc/t.json
    run "15. --samples into /proc" 2 "--samples: cannot write /proc/s.png: the folder /proc takes no new files" \
      train --model unet "${tiny[@]}" --samples /proc/s.png
    run "15. bench --results into /proc" 2 "--results: cannot write /proc/r.json: the folder /proc takes no new files" \
      bench --workload tiny --stages 2 --steps 1 --warmup 0 --results /proc/r.json
    if grep -q "^tiny" "$work/out.txt"; then fail "15. bench --results into /proc: benchmarked before the error"; fi
    run "15. bench --results in a folder /proc cannot take" 2 \
      "--results: cannot create the folder /proc/x \(.*\); give a path in a folder you can write to" \
      bench --workload tiny --stages 2 --steps 1 --warmup 0 --results /proc/x/r.json
  fi
  # gpipe schedule: a grid of few pairs but many rows (K = 8192, M = 2) is refused before it is made,
  # and V is checked before the size.
  run "15. schedule --stages 8192" 2 "makes a grid of 8192 rows of up to 16396 slots; gpipe schedule shows at most 16777216 cells" \
    schedule --schedule v-half --stages 8192 --micro-batches 2
  run "15. schedule --schedule v-half --virtual-stages 2147483647" 2 \
    "--virtual-stages 2147483647: the v-half schedule runs 2 stages per device" \
    schedule --schedule v-half --virtual-stages 2147483647
  # A closed standard output: the system's reason for it, not that of an earlier call.
  timeout "$hang" "$gpipe" train "${tiny[@]}" --steps 1 2>"$work/err.txt" >&-
  status=$?
  if [ "$status" -ne 0 ] && grep -q "cannot write to standard output: Bad file descriptor" "$work/err.txt"; then
    pass "15. a closed standard output: exit $status, 'Bad file descriptor'"
  else fail "15. a closed standard output: exit $status: $(cat "$work/err.txt")"; fi
  # Inputs that are not files: each named for what it is.
  mkfifo "$work/fifo"
  ln -s /dev/null "$work/null-link.pt"
  run "15. --resume a FIFO" 2 "--resume: $work/fifo is a FIFO \(a named pipe\), not a file" \
    train "${tiny[@]}" --resume "$work/fifo"
  run "15. --resume a folder" 2 "--resume: $work is a folder, not a file" train "${tiny[@]}" --resume "$work"
  run "15. --model /dev/zero" 2 "--model: /dev/zero is a character device, not a file" \
    train --model /dev/zero --data "$work/data.pt" --loss mse
  run "15. --data, a link to /dev/null" 2 "--data: $work/null-link.pt \(a link to /dev/null\) is a character device, not a file" \
    train --model "$work/model.pt" --data "$work/null-link.pt" --loss mse
  run "15. --weight-decay 1e308" 2 "--weight-decay must be a number from 0 to 3.4e38, float's largest \(got 1e\+308\)" \
    train "${tiny[@]}" --weight-decay 1e308
  run "15. --prompt alone" 2 "--prompt belongs to --generate N, the bytes to sample from --model gpt; add --model gpt --generate 200" \
    train --prompt hello
  run "15. --generate beyond its limit" 2 "--generate 100000000: at most 100000 bytes" train --model gpt --generate 100000000
  mkdir "$work/plain-text" "$work/little-text"
  for n in $(seq 1 300); do echo "a line of text, $n"; done >"$work/plain-text/words"
  printf 'one\n%%\ntwo\n%%\nthree\n' >"$work/little-text/fortunes"
  run "15. gpt --data-dir without %" 2 "plain-text holds 1 file of text, but no line \"%\" in any" \
    train --model gpt --data-dir "$work/plain-text"
  run "15. gpt --data-dir with little text" 2 "little-text holds too little text: [0-9]+ bytes to train on and [0-9]+ to test on" \
    train --model gpt --data-dir "$work/little-text"
  # A checkpoint file of another model, refused before --balance-by time profiles the ResNet.
  run "15. --model resnet --resume of the CNN's file" 2 "--resume: .*ckpt.pt is a checkpoint file of another model" \
    train --model resnet "${tiny[@]}" --stages 2 --resume "$work/ckpt.pt"
  if grep -q "balance by" "$work/out.txt"; then fail "15. --model resnet --resume: profiled before the refusal"; fi
fi

if part late_models; then  # cost 35
  make_models
  make_checkpoint
  if [ "$torch" = 1 ]; then
    "$gpipe" train "${model[@]}" --data "$work/data.pt" --steps 1 --save "$work/script-ckpt.pt" >/dev/null 2>&1
    run "15. a TorchScript model's file resumed by the CNN" 2 "script-ckpt.pt is the checkpoint file of a TorchScript model" \
      train "${tiny[@]}" --resume "$work/script-ckpt.pt"
    run "15. the CNN's file resumed by a TorchScript model" 2 "ckpt.pt is the checkpoint file of a built-in model" \
      train "${model[@]}" --data "$work/data.pt" --resume "$work/ckpt.pt"
    run "15. zbv on a 1-layer model" 2 "the zbv schedule with 2 stages per device needs at least 2 layers; use a schedule of one stage per device" \
      train --model "$work/one-layer.pt" --data "$work/data.pt" --loss mse --schedule zbv --stages 1
    run "15. float64 targets" 2 "--loss mse: the targets are Double \(float64\), but the model outputs Float \(float32\)" \
      train "${model[@]}" --data "$work/target64.pt"
    run "15. float64 inputs" 2 "the data's 'input' is Double \(float64\): save it as float32" \
      train "${model[@]}" --data "$work/input64.pt"
    run "15. uint8 inputs" 2 "the data's 'input' is Byte \(uint8\): save it as float32" \
      train "${model[@]}" --data "$work/input-u8.pt"
    run "15. a float64 model" 2 "the model's parameter 0.weight is Double \(float64\), but gpipe trains float32 models" \
      train --model "$work/model64.pt" --data "$work/data.pt" --loss mse
    run "15. a layer that keeps one row, cross_entropy" 2 "layer 1 turns 2 samples \(shape \[2, 8\]\) into 1 row" \
      train --model "$work/rows.pt" --data "$work/classes.pt" --loss cross_entropy
    run "15. torch.save's old format" 2 "old-format.pt was written in torch.save's old format \(_use_new_zipfile_serialization=False\)" \
      train "${model[@]}" --data "$work/old-format.pt"
    run "15. a sparse tensor" 2 "sparse.pt holds a sparse tensor" train "${model[@]}" --data "$work/sparse.pt"
    run "15. the loss overflows before any update" 1 "in step 1 .*no update was applied yet, so the learning rate is not the cause" \
      train "${model[@]}" --data "$work/overflow.pt" --steps 2
    # A layer that changes its input in place trains wherever the cut puts it (a stage runs it on a
    # copy of the input it keeps), under auto's profile, --balance-by time and split backwards.
    for cut in "--balance 1,3" "--balance 1,3 --schedule zb1p" "--balance 2,2 --schedule auto" "--balance-by time"; do
      run "15. an in-place layer, $cut, trains" 0 "step 1/" \
        train --model "$work/in-place.pt" --data "$work/data.pt" --loss mse --stages 2 $cut --batch-size 8 --steps 1 --json
    done
    # One that changes its input in place only with a graph, which gpipe cannot find beforehand: auto's
    # profile cannot time it, so by default the task's own schedule runs, saying why; asked for, auto fails.
    run "15. an in-place layer only with a graph, inside a stage, trains" 0 "--schedule auto could not profile the model, so the task's own schedule runs: layer 1 \('1'\) changes its input in place" \
      train --model "$work/graph-in-place.pt" --data "$work/data.pt" --loss mse --stages 2 --balance 2,2 --batch-size 8 --steps 1
    run "15. an in-place layer only with a graph, under --schedule auto" 2 "--schedule auto: layer 1 \('1'\) changes its input in place when it runs with a graph" \
      train --model "$work/graph-in-place.pt" --data "$work/data.pt" --loss mse --stages 2 --balance 2,2 --batch-size 8 --steps 1 --schedule auto
    run "15. an in-place layer only with a graph that begins a stage" 2 "layer 1 \('1'\) begins stage 1 of the cut \{1, 3\}, and where its input takes a gradient .*in-place.*cut elsewhere with --balance" \
      train --model "$work/graph-in-place.pt" --data "$work/data.pt" --loss mse --stages 2 --balance 1,3 --schedule gpipe --batch-size 8 --steps 1
    # gpipe plan's errors are train's: no C++ stack, no TorchScript traceback.
    run "15. plan: a model that ends with a tuple" 2 "the model's last layer returns a tuple \(shape \(\[8, 6\], \[8, 6\]\)\), but the loss takes one tensor" \
      plan --model "$work/tuple.pt" --input-shape 6 --devices 2 --batch 8
    run "15. plan: a layer returning a tuple holding an int" 2 "layer 1 \('1', __torch__\.(models\.)?IntPair\) returns Tuple\[Tensor, int\], not a Tensor or a Tuple of Tensors" \
      plan --model "$work/int-tuple.pt" --input-shape 6 --devices 2 --batch 8
    run "15. plan: a layer returning a dict" 2 "returns Dict.*, not a Tensor" \
      plan --model "$work/dict.pt" --input-shape 6 --devices 2 --batch 8
    run "15. plan --input-shape the model does not take" 2 "--input-shape 5: layer 0 fails on .*mat1 and mat2 shapes cannot be multiplied" \
      plan --model "$work/model.pt" --input-shape 5 --devices 2 --batch 8
    if grep -q "Traceback of TorchScript" "$work/err.txt"; then fail "15. plan: TorchScript's traceback without --verbose"; fi
    run "15. plan: an Embedding first, random floats" 2 "--input-shape 5: layer 0 fails on .*--input-tokens" \
      plan --model "$work/embedding.pt" --input-shape 5 --devices 2 --batch 8
    if timeout "$hang" "$gpipe" plan --model "$work/embedding.pt" --input-shape 5 --input-tokens 16 --devices 2 \
         --batch 8 --json >"$work/out.txt" 2>"$work/err.txt" &&
       "$python" -c 'import json, sys; assert json.loads(open(sys.argv[1]).readline())["predicted_step_s"] > 0' "$work/out.txt"; then
      pass "15. plan: an Embedding first, --input-tokens 16: planned"
    else fail "15. plan --input-tokens: $(head -c 300 "$work/err.txt")"; fi
    run "15. plan: token ids beyond the Embedding" 2 "--input-tokens 1000: layer 0 fails on" \
      plan --model "$work/embedding.pt" --input-shape 5 --input-tokens 1000 --devices 2 --batch 8
    run "15. plan --input-shape too large to profile" 2 "--input-shape 100000,100000: the model is profiled here on 8 samples of this shape, 298 GiB" \
      plan --model "$work/model.pt" --input-shape 100000,100000 --devices 2 --batch 8
  fi
fi

parts_end || failures=$((failures + 1))
finish
