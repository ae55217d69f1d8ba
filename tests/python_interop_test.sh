#!/usr/bin/env bash
# python_interop_test.sh: a model and data saved in Python, trained by `gpipe train`, loaded back in
# Python, equal to plain torch.optim.SGD on one device. Exits 77 (skipped) without Python torch.
# Usage: python_interop_test.sh PATH/TO/gpipe
set -u
gpipe="$1"
python=/usr/bin/python3
if ! "$python" -c "import torch" 2>/dev/null; then
  echo "SKIPPED: Debian's python3-torch is not installed (apt-get install python3-torch)"
  exit 77
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" - "$gpipe" "$work" <<'PY'
import copy, subprocess, sys
import torch

gpipe, work = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
    torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
torch.jit.script(model).save(f"{work}/model.pt")
x, y = torch.randn(37, 6), torch.randn(37, 3)
torch.save({"input": x, "target": y}, f"{work}/data.pt")

steps, lr = 6, 0.05
reference = copy.deepcopy(model)
sgd = torch.optim.SGD(reference.parameters(), lr=lr, momentum=0.9)
for _ in range(steps):
    sgd.zero_grad()
    torch.nn.functional.mse_loss(reference(x), y).backward()
    sgd.step()
expected = dict(reference.named_parameters())

failures = 0
for stages, micro, mode in [(1, 1, "never"), (2, 4, "always"), (3, 5, "except_last"), (4, 8, "never"), (7, 3, "always")]:
    out = f"{work}/out-{stages}-{micro}-{mode}.pt"
    cmd = [gpipe, "train", "--model", f"{work}/model.pt", "--data", f"{work}/data.pt", "--loss", "mse",
           "--optimizer", "sgd", "--lr", str(lr), "--batch-size", "37", "--steps", str(steps),
           "--stages", str(stages), "--micro-batches", str(micro), "--checkpoint", mode, "--save", out, "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        print(f"FAILED: K={stages} M={micro} {mode}: exit {run.returncode}: {run.stderr}")
        failures += 1
        continue
    trained = torch.jit.load(out)
    got = dict(trained.named_parameters())
    worst = 0.0
    assert got.keys() == expected.keys(), (got.keys(), expected.keys())
    for name, want in expected.items():
        diff = (got[name] - want).abs().max().item()
        worst = max(worst, diff / max(want.abs().max().item(), 1e-30))
    moved = max((got[n] - p).abs().max().item() for n, p in model.named_parameters())
    ok = worst <= 1e-5 and moved > 1e-3
    print(f"{'ok' if ok else 'FAILED'}: K={stages} M={micro} {mode}: max relative difference {worst:.2e}, "
          f"parameters moved {moved:.3f}")
    failures += 0 if ok else 1
# A checkpoint of another model is refused before any training.
other = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
torch.jit.script(other).save(f"{work}/other.pt")
run = subprocess.run([gpipe, "train", "--model", f"{work}/other.pt", "--data", f"{work}/data.pt", "--loss", "mse",
                      "--optimizer", "sgd", "--resume", f"{work}/out-2-4-always.pt", "--stages", "2"],
                     capture_output=True, text=True)
ok = run.returncode != 0 and "checkpoint of another model" in run.stderr and "epoch" not in run.stdout
print(f"{'ok' if ok else 'FAILED'}: resuming another model's checkpoint: {run.stderr.strip()[:150]}")
failures += 0 if ok else 1
print(f"{6 - failures} passed, {failures} failed")
sys.exit(1 if failures else 0)
PY
