#!/usr/bin/env bash
# python_interop_test.sh: a model and data saved in Python, trained by `gpipe train`, loaded back in
# Python with torch.jit.load, equal to the same training in plain PyTorch on one device: every
# optimizer flag, learning-rate schedule and gradient clipping; resumed with another K; and, when
# MPI is built, one checkpoint file written under mpirun. Exits 77 (skipped) without Python torch.
# Usage: python_interop_test.sh PATH/TO/gpipe [MPI]   (MPI: 1 when gpipe is built with MPI)
set -u
gpipe="$1"
mpi="${2:-0}"
python=/usr/bin/python3
if ! "$python" -c "import torch" 2>/dev/null; then
  echo "SKIPPED: Debian's python3-torch is not installed (apt-get install python3-torch)"
  exit 77
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" - "$gpipe" "$work" "$mpi" "$(dirname "$0")/mpirun.sh" <<'PY'
import copy, math, subprocess, sys
import torch

gpipe, work, mpi, mpirun = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
    torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
torch.jit.script(model).save(f"{work}/model.pt")
rows = 37
x, y = torch.randn(rows, 6), torch.randn(rows, 3)
torch.save({"input": x, "target": y}, f"{work}/data.pt")


def reference(steps, batch, optimizer="sgd", lr=0.05, momentum=0.0, nesterov=False, weight_decay=None,
              betas=(0.9, 0.999), schedule="constant", warmup=0, step_size=None, gamma=0.1, clip=0.0,
              drop_last=False):
    """The same run in plain PyTorch: batches in order (--no-shuffle), the last partial one kept."""
    net = copy.deepcopy(model)
    params = list(net.parameters())
    if optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay or 0)
    elif optimizer == "adam":
        opt = torch.optim.Adam(params, lr=lr, betas=betas, weight_decay=weight_decay or 0)
    else:
        opt = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=0.01 if weight_decay is None else weight_decay)
    starts = [s for s in range(0, rows, batch) if not (drop_last and s + batch > rows)]
    step_size = step_size or len(starts)
    if warmup:  # warm-up, then the schedule, as one LambdaLR
        def factor(t):
            if t < warmup:
                return (t + 1) / warmup
            if schedule == "cosine":
                return 0.5 * (1 + math.cos(math.pi * min(1.0, (t - warmup) / max(1, steps - warmup))))
            return gamma ** ((t - warmup) // step_size) if schedule == "step" else 1.0
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    elif schedule == "cosine":
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    elif schedule == "step":
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=step_size, gamma=gamma)
    else:
        scheduler = None
    for t in range(steps):
        s = starts[t % len(starts)]
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x[s:s + batch]), y[s:s + batch]).backward()
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
            assert norm > clip, f"gradient norm {norm} below {clip}: the case would not test clipping"
        opt.step()
        if scheduler:
            scheduler.step()
    return dict(net.named_parameters())


def compare(name, out, expected):
    trained = torch.jit.load(out)
    got = dict(trained.named_parameters())
    assert got.keys() == expected.keys(), (got.keys(), expected.keys())
    worst = 0.0
    for key, want in expected.items():
        diff = (got[key] - want).abs().max().item()
        worst = max(worst, diff / max(want.abs().max().item(), 1e-30))
    moved = max((got[n] - p).abs().max().item() for n, p in model.named_parameters())
    ok = worst <= 1e-5 and moved > 1e-3
    print(f"{'ok' if ok else 'FAILED'}: {name}: max relative difference {worst:.2e}, parameters moved {moved:.3f}")
    return ok


def train(flags, out, launcher=()):
    cmd = list(launcher) + [gpipe, "train", "--model", f"{work}/model.pt", "--data", f"{work}/data.pt",
                            "--loss", "mse", "--no-shuffle", "--save", out, "--json"] + flags
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        print(f"FAILED: {' '.join(flags)}: exit {run.returncode}: {run.stderr.strip()[-400:]}")
    return run.returncode == 0


results = []


def case(name, flags, expected, launcher=()):
    out = f"{work}/out-{len(results)}.pt"
    results.append(train(flags, out, launcher) and compare(name, out, expected))


# Plain SGD (torch.optim.SGD(lr): momentum 0) over K, M and checkpoint modes; one batch per step.
whole = reference(6, rows)
for stages, micro, mode in [(1, 1, "never"), (2, 4, "always"), (3, 5, "except_last"), (4, 8, "never"),
                            (7, 3, "always")]:
    case(f"sgd K={stages} M={micro} {mode}", ["--optimizer", "sgd", "--lr", "0.05", "--batch-size", str(rows),
         "--steps", "6", "--stages", str(stages), "--micro-batches", str(micro), "--checkpoint", mode], whole)

# Every optimizer flag: batches of 10 over 37 rows (the last one has 7 rows), 9 steps over 3 epochs.
pipeline = ["--batch-size", "10", "--steps", "9", "--stages", "3", "--micro-batches", "3"]
for name, flags, kwargs in [
    ("sgd --momentum 0.9 --nesterov --weight-decay 0.01",
     ["--optimizer", "sgd", "--momentum", "0.9", "--nesterov", "--weight-decay", "0.01"],
     dict(momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("adam --betas 0.8,0.99 --weight-decay 0.1", ["--optimizer", "adam", "--lr", "0.01", "--betas", "0.8,0.99",
     "--weight-decay", "0.1"], dict(optimizer="adam", lr=0.01, betas=(0.8, 0.99), weight_decay=0.1)),
    ("adamw (weight decay 0.01 by default)", ["--optimizer", "adamw", "--lr", "0.01"],
     dict(optimizer="adamw", lr=0.01)),
    ("--lr-schedule cosine", ["--optimizer", "sgd", "--momentum", "0.5", "--lr-schedule", "cosine"],
     dict(momentum=0.5, schedule="cosine")),
    ("--lr-schedule step (every epoch by default)", ["--optimizer", "sgd", "--lr-schedule", "step",
     "--lr-gamma", "0.5"], dict(schedule="step", gamma=0.5)),
    ("--lr-schedule step --lr-step-size 2", ["--optimizer", "sgd", "--lr-schedule", "step", "--lr-step-size", "2"],
     dict(schedule="step", step_size=2)),
    ("adam --warmup-steps 3 --lr-schedule cosine", ["--optimizer", "adam", "--lr", "0.01", "--warmup-steps", "3",
     "--lr-schedule", "cosine"], dict(optimizer="adam", lr=0.01, warmup=3, schedule="cosine")),
    ("--clip-grad-norm 0.05 (the norm over all stages)", ["--optimizer", "sgd", "--clip-grad-norm", "0.05"],
     dict(clip=0.05)),
    ("--drop-last", ["--optimizer", "sgd", "--drop-last"], dict(drop_last=True)),
]:
    case(name, pipeline + flags + ([] if "--lr" in flags else ["--lr", "0.05"]), reference(9, 10, **kwargs))

# Saved at step 4 with K=2, resumed with K=3 to step 9: Adam's state travels in the one file.
adam = ["--optimizer", "adam", "--lr", "0.01", "--batch-size", "10", "--micro-batches", "3"]
ok = train(adam + ["--steps", "4", "--stages", "2"], f"{work}/half.pt")
ok = ok and train(adam + ["--steps", "9", "--stages", "3", "--resume", f"{work}/half.pt"], f"{work}/whole.pt")
results.append(ok and compare("adam saved with K=2 at step 4, resumed with K=3", f"{work}/whole.pt",
                              reference(9, 10, optimizer="adam", lr=0.01)))

# Under mpirun: one TorchScript file from 2 ranks (the clip norm summed across them), loaded here.
if mpi:
    launch = ["bash", mpirun, "2"]
    case("mpirun -np 2: one file, --clip-grad-norm across ranks", pipeline[:4] + ["--stages", "2", "--lr", "0.05",
         "--micro-batches", "3", "--optimizer", "sgd", "--momentum", "0.9", "--clip-grad-norm", "0.05"],
         reference(9, 10, momentum=0.9, clip=0.05), launch)
    ok = train(adam + ["--steps", "4", "--stages", "2"], f"{work}/mpi-half.pt", launch)
    ok = ok and train(adam + ["--steps", "9", "--stages", "3", "--resume", f"{work}/mpi-half.pt"],
                      f"{work}/mpi-whole.pt", ["bash", mpirun, "3"])
    results.append(ok and compare("mpirun: saved by 2 ranks, resumed by 3", f"{work}/mpi-whole.pt",
                                  reference(9, 10, optimizer="adam", lr=0.01)))

# Dropout and BatchNorm in a TorchScript model: Dropout seeded by --seed and replayed exactly when a
# forward is recomputed, BatchNorm's statistics updated once per step: every checkpoint mode gives the
# same parameters and buffers; another seed gives other ones.
noisy = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                            torch.nn.Dropout(0.5), torch.nn.Linear(16, 3))
torch.jit.script(noisy).save(f"{work}/noisy.pt")
states = {}
for mode, seed in [("never", "0"), ("always", "0"), ("except_last", "0"), ("never", "1")]:
    out = f"{work}/noisy-{mode}-{seed}.pt"
    run = subprocess.run([gpipe, "train", "--model", f"{work}/noisy.pt", "--data", f"{work}/data.pt", "--loss", "mse",
                          "--stages", "2", "--micro-batches", "4", "--batch-size", "37", "--steps", "3",
                          "--schedule", "task", "--checkpoint", mode, "--seed", seed, "--save", out], capture_output=True, text=True)
    states[mode, seed] = torch.jit.load(out).state_dict() if run.returncode == 0 else None
same = lambda a, b: a is not None and b is not None and all(torch.equal(a[k], b[k]) for k in a)
ok = (same(states["never", "0"], states["always", "0"]) and same(states["never", "0"], states["except_last", "0"])
      and states["never", "1"] is not None and not same(states["never", "0"], states["never", "1"])
      and states["never", "0"]["1.num_batches_tracked"].item() == 3)
print(f"{'ok' if ok else 'FAILED'}: Dropout and BatchNorm: every checkpoint mode equal, another seed differs")
results.append(ok)

# BatchNorm the GPipe way, written back into the saved file: each micro-batch normalized by its own
# statistics, the running ones updated once per step from all its rows (mean, unbiased variance).
torch.manual_seed(1)
normed = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16, momentum=0.2), torch.nn.ReLU(),
                             torch.nn.Linear(16, 3))
torch.jit.script(normed).save(f"{work}/normed.pt")


def batch_norm_reference(steps, batch, micro_batches, deferred):
    net = copy.deepcopy(normed)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    starts = list(range(0, rows, batch))
    for t in range(steps):
        s = starts[t % len(starts)]
        xb, yb = x[s:s + batch], y[s:s + batch]
        opt.zero_grad()
        seen = []
        for xi, yi in zip(torch.tensor_split(xb, micro_batches), torch.tensor_split(yb, micro_batches)):
            kept = [b.clone() for b in net[1].buffers()]
            h = net[0](xi)
            seen.append(h.detach())
            out = net[3](net[2](net[1](h)))
            (torch.nn.functional.mse_loss(out, yi) * len(xi) / len(xb)).backward()
            if deferred:  # the running statistics as they were (training-mode normalization does not read them)
                with torch.no_grad():
                    for b, k in zip(net[1].buffers(), kept):
                        b.copy_(k)
        opt.step()
        if deferred:
            with torch.no_grad():
                every = torch.cat(seen)
                bn = net[1]
                bn.num_batches_tracked += 1
                bn.running_mean.mul_(1 - bn.momentum).add_(every.mean(0) * bn.momentum)
                bn.running_var.mul_(1 - bn.momentum).add_(every.var(0, unbiased=True) * bn.momentum)
    return net.state_dict()


for mode in ["deferred", "per-micro-batch"]:
    out = f"{work}/normed-{mode}.pt"
    run = subprocess.run([gpipe, "train", "--model", f"{work}/normed.pt", "--data", f"{work}/data.pt", "--loss", "mse",
                          "--stages", "2", "--micro-batches", "2", "--batch-size", "16", "--steps", "3",
                          "--checkpoint", "always", "--optimizer", "sgd", "--lr", "0.05", "--no-shuffle",
                          "--batch-norm", mode, "--save", out], capture_output=True, text=True)
    want = batch_norm_reference(3, 16, 2, mode == "deferred")
    got = torch.jit.load(out).state_dict() if run.returncode == 0 else None
    ok = got is not None and all(torch.allclose(got[k].double(), want[k].double(), rtol=1e-5, atol=1e-6) for k in want)
    print(f"{'ok' if ok else 'FAILED'}: BatchNorm --batch-norm {mode}: parameters and running statistics "
          f"(batches tracked {got['1.num_batches_tracked'].item() if got else None}) equal PyTorch's"
          + ("" if ok else f": {run.stderr.strip()[-300:]}"))
    results.append(ok)

# A checkpoint of another model is refused before any training.
other = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
torch.jit.script(other).save(f"{work}/other.pt")
run = subprocess.run([gpipe, "train", "--model", f"{work}/other.pt", "--data", f"{work}/data.pt", "--loss", "mse",
                      "--optimizer", "sgd", "--resume", f"{work}/half.pt", "--stages", "2"],
                     capture_output=True, text=True)
ok = run.returncode != 0 and "checkpoint file of another model" in run.stderr and "epoch" not in run.stdout
print(f"{'ok' if ok else 'FAILED'}: resuming another model's checkpoint: {run.stderr.strip()[:150]}")
results.append(ok)
failures = results.count(False)
print(f"{len(results) - failures} passed, {failures} failed")
sys.exit(1 if failures else 0)
PY
