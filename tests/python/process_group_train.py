"""One process of tests/python/test_process_group.py: torch.distributed initialized by hand (tcp://,
no torchrun and none of its variables), then GPipe over a process group; prints a JSON line with the
losses and this rank's own parameters (those it trains).

Usage: process_group_train.py RANK WORLD_SIZE PORT GROUPS   (GROUPS: "default", "world", "pairs":
ranks {0, 1} and {2, 3} each a pipeline of their own, "pairs_leave": the same, but rank 3 ends after
one step, so that rank 2's next step fails (its message printed as "error"), or "again": the default group, then
destroy_process_group and a new default group at AGAIN_PORT (PORT given as "PORT,AGAIN_PORT"), over which a new GPipe trains once the
first is deleted, and then a GPipe after another over it), or "again_one": the same, but only rank 0 keeps
its first GPipe over the new group's first attempt, so that rank 1 hears why rank 0 cannot take the
group, or "again_late": the same, both first GPipes deleted, but rank 1 comes to the new group after
rank 0 has given up on it once (GPIPE_TIMEOUT 5 s; rank 1 comes at 7.5 s, 2.5 s from either end),
and each tries again until it trains, or "profile_fails": schedule="auto" over a model whose forward
fails on rank 0 alone (a buffer
says so, which the check that every rank has the same model leaves out, as it compares parameters
only: rank 0 profiles for every rank, and the others hear that it failed), or "named_v": a named zbv
without a balance over a model of four layers of very unequal time (its cut [1, 1, 1, 1]), cut and
ordered by the layers' profiled time (each rank profiles; every rank takes rank 0's cut and times),
printing its program; WORLD_SIZE 1 with RANK 0: one process alone."""
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import gpipe

rank, size, groups = int(sys.argv[1]), int(sys.argv[2]), sys.argv[4]
port, _, again_port = sys.argv[3].partition(",")
group = None
if size > 1:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    if groups == "world":
        group = dist.group.WORLD
    elif groups in ("pairs", "pairs_leave"):
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every process makes every group
        group = pairs[rank // 2]


class FailsOnRankZero(torch.nn.Module):
    """Its input as it is; raises in forward where its buffer says so (rank 0's copy)."""

    def __init__(self, fails):
        super().__init__()
        self.register_buffer("fails", torch.tensor(1 if fails else 0))

    def forward(self, x):
        if bool(self.fails):
            raise RuntimeError("this layer fails on rank 0")
        return x


if groups == "profile_fails":
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), FailsOnRankZero(rank == 0), torch.nn.Linear(16, 4))
    began = time.monotonic()
    try:
        gpipe.GPipe(model, devices=2, chunks=4, process_group=group).train_step(torch.randn(16, 12),
                                                                                 torch.randn(16, 4), loss="mse")
        error = None
    except (RuntimeError, ValueError) as e:
        error = f"{type(e).__name__}: {e}"
    print(json.dumps({"error": error, "seconds": time.monotonic() - began}), flush=True)
    sys.exit(0)


def unequal_layers():
    """Four layers whose times differ by orders of magnitude: zbv's two stages per device unequal."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.Linear(1024, 16), torch.nn.Linear(16, 16),
                               torch.nn.Linear(16, 8))


if groups == "named_v":
    pipe = gpipe.GPipe(unequal_layers(), devices=2, chunks=8, schedule="zbv", process_group=group)
    pipe.train_step(torch.randn(64, 64), torch.randn(64, 8), loss="mse")  # the first batch cuts the model
    print(json.dumps({"balance": pipe.balance, "program": pipe.schedule_text()}), flush=True)
    sys.exit(0)


def train():
    """The model and its pipeline over `group`, after 4 steps, and the losses."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 4))
    pipe = gpipe.GPipe(model, devices=2, chunks=4, balance=[2, 3], schedule="1f1b", process_group=group)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1)
    losses = []
    for step in range(1 if groups == "pairs_leave" and rank == 3 else 4):
        x, y = torch.randn(16, 12, generator=data), torch.randn(16, 4, generator=data)
        opt.zero_grad()
        try:
            losses.append(pipe.train_step(x, y, loss="mse"))
        except RuntimeError as e:
            if groups != "pairs_leave":
                raise
            losses.append(str(e))
            break
        opt.step()
    return model, pipe, losses


model, pipe, losses = train()
refused = refused_s = None
if groups == "again_late":
    first = losses
    del model, pipe
    gc.collect()
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{again_port}", rank=rank, world_size=size)
    os.environ["GPIPE_TIMEOUT"] = "5"
    if rank == 1:
        time.sleep(7.5)
    refused = []
    while True:
        try:
            model, pipe, losses = train()
            break
        except ValueError as e:
            refused.append(str(e))
            assert len(refused) < 3, refused
    assert losses == first, (losses, first)
if groups in ("again", "again_one"):
    first = losses
    if groups == "again_one" and rank == 1:
        del model, pipe
        gc.collect()
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{again_port}", rank=rank, world_size=size)
    began = time.monotonic()
    try:
        train()  # the first GPipe still runs over the group before (rank 0's only, with "again_one")
    except ValueError as e:
        refused = str(e)
    refused_s = time.monotonic() - began
    if groups == "again" or rank == 0:
        del model, pipe
        gc.collect()
    model, pipe, losses = train()
    assert losses == first, (losses, first)
    # A pipeline after another over one group (gpipe lets go of the group's store when its last
    # pipeline ends, and starts over it with keys of their own) trains alike.
    del model, pipe
    gc.collect()
    model, pipe, losses = train()
    assert losses == first, (losses, first)
# Device d's layers (balance [2, 3]): 0-1 on device 0, 2-4 on device 1; alone, every layer.
device = pipe.rank % 2 if size > 1 else None
own = [n for n, _ in model.named_parameters() if device is None or (int(n.split(".")[0]) >= 2) == (device == 1)]
params = dict(model.named_parameters())
print(json.dumps({"losses": [repr(v) for v in losses], "describe": pipe.describe(), "refused": refused,
                  "refused_s": refused_s,
                  "parameters": {n: params[n].detach().flatten().tolist() for n in own}}), flush=True)
