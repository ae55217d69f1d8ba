"""Trains a small model with a skip connection (and with --tied, an output layer tied to the
embedding) through gpipe.GPipe for a few steps and saves what this process trained: run by
test_mpi.py in one process and under `mpirun -np 2`.

    python3 mpi_train.py OUT_DIR [--tied | --traced] [--by-time] [--schedule NAME] [--checkpoint MODE]
                         [--configs NAME:MODE,...]
                         [--unseeded] [--unseeded-model] [--raise-on-rank-1] [--rank-1-ends-early return|exit]

--schedule and --checkpoint pick the step program (default: interleaved over 4 stages, except_last);
a schedule of one stage per device cuts the model in 2 stages, interleaved, zbv and v-half in 4.
--configs trains each SCHEDULE:CHECKPOINT in turn, a new model and pipeline each, in one process (one
interpreter, one job, not one per configuration), into OUT_DIR/SCHEDULE-CHECKPOINT; SCHEDULE:CHECKPOINT:held
trains within pipe.update_on_devices(opt), into OUT_DIR/SCHEDULE-CHECKPOINT-held.

With --traced the model is Traced, not a Sequential, cut where its BatchNorm's block begins.
With --by-time the model is cut by measured time (balance=None): under MPI every rank takes rank 0's cut.
With --unseeded each rank draws its own batches: every rank refuses the first step.
With --unseeded-model each rank initialises its own model: every rank refuses it.
With --rank-1-ends-early return|exit rank 1's script ends after one step (its last line, or sys.exit(0))
while rank 0 goes on: rank 0 stops with an error naming rank 1, and the job ends.
With --raise-on-rank-1 rank 1's script raises after a step and a trace to a path rank 0 cannot write:
the trace fails on every rank, and the uncaught exception ends the job.
"""
import contextlib
import os
import sys

import torch

import gpipe


class TiedHead(torch.nn.Module):
    """An output projection reading the embedding's weight."""
    def __init__(self, embedding):
        super().__init__()
        self.weight = embedding.weight

    def forward(self, x):
        return x @ self.weight.t()


def model(tied):
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(24, 16)
    return torch.nn.Sequential(
        embedding, gpipe.Stash("e"), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
        gpipe.Pop("e"), torch.nn.LayerNorm(16), torch.nn.Linear(16, 16),
        TiedHead(embedding) if tied else torch.nn.Linear(16, 24))


class Traced(torch.nn.Module):
    """Not a Sequential (gpipe traces it): a BatchNorm inside a block, deferred, and a head tied to the
    embedding; stages begin at split_points."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(24, 16)
        self.block = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
        self.norms = torch.nn.Sequential(torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 16))

    def forward(self, x):
        h = self.embed(x)
        h = h + self.block(h)
        h = self.norms[1](self.norms[0](h.transpose(1, 2)).transpose(1, 2))
        return h @ self.embed.weight.t()


def flag(name, default):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def main():
    if "--configs" in sys.argv:
        for config in flag("--configs", "").split(","):
            schedule, checkpoint, *held = config.split(":")
            out = os.path.join(sys.argv[1], config.replace(":", "-"))
            os.makedirs(out, exist_ok=True)
            train(out, "--tied" in sys.argv, schedule, checkpoint, held == ["held"])
        return
    train(sys.argv[1], "--tied" in sys.argv, flag("--schedule", "interleaved"), flag("--checkpoint", "except_last"))


def train(out, tied, schedule, checkpoint, held=False):
    m = Traced() if "--traced" in sys.argv else model(tied)
    balance = None if "--by-time" in sys.argv or "--traced" in sys.argv else \
        [3, 3, 2, 1] if schedule in ("interleaved", "zbv", "v-half") else [5, 4]
    if "--unseeded-model" in sys.argv:
        with torch.no_grad():
            m[2].weight.add_(torch.randn(16, 16, generator=torch.Generator().manual_seed(torch.seed())))
        try:
            gpipe.GPipe(m, balance=balance, chunks=4, schedule="interleaved", devices=2)
        except ValueError as e:
            torch.save({"refused": str(e)}, f"{out}/rank{os.environ.get('OMPI_COMM_WORLD_RANK', '0')}.pt")
        return
    cut = {"split_points": ["norms"]} if "--traced" in sys.argv else {"balance": balance}
    pipe = gpipe.GPipe(m, chunks=4, schedule=schedule, checkpoint=checkpoint, devices=2, **cut)
    # This rank's stages' parameters; model.parameters() would do too (the others get no gradient).
    opt = torch.optim.Adam(m.parameters() if balance is None else pipe.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    if "--unseeded" in sys.argv:
        g.seed()  # each rank its own batches
        try:
            pipe.train_step(torch.randint(24, (10, 5), generator=g), torch.randint(24, (10, 5), generator=g))
        except ValueError as e:
            torch.save({"refused": str(e)}, f"{out}/rank{pipe.rank}.pt")
        return
    if "--raise-on-rank-1" in sys.argv:
        pipe.train_step(torch.randint(24, (10, 5), generator=g), torch.randint(24, (10, 5), generator=g))
        try:
            pipe.trace("/proc/no/such/folder/step.json")
        except Exception as e:  # noqa: BLE001  (every rank must get here)
            print(f"rank {pipe.rank}: trace refused: {e}", flush=True)
        if pipe.rank == 1:
            raise RuntimeError("rank 1 stops here")
        pipe.train_step(torch.randint(24, (10, 5), generator=g), torch.randint(24, (10, 5), generator=g))
        return
    if "--rank-1-ends-early" in sys.argv:
        for step in range(3):
            if pipe.rank == 1 and step == 1:
                if flag("--rank-1-ends-early", "return") == "exit":
                    sys.exit(0)
                return
            pipe.train_step(torch.randint(24, (10, 5), generator=g), torch.randint(24, (10, 5), generator=g))
        return
    losses = []
    with pipe.update_on_devices(opt) if held else contextlib.nullcontext():  # each step's update on the devices
        for _ in range(3):
            x, y = torch.randint(24, (10, 5), generator=g), torch.randint(24, (10, 5), generator=g)
            opt.zero_grad()
            losses.append(pipe.train_step(x, y, loss="cross_entropy"))
            opt.step()
    held = {name: p.detach().clone() for name, p in m.named_parameters() if any(p is q for q in pipe.parameters())}
    for name, b in m.named_buffers():  # a BatchNorm's, where its module's parameters are trained
        owner = m.get_submodule(name.rpartition(".")[0])
        if any(p is q for p in owner.parameters() for q in pipe.parameters()):
            held[name] = b.clone()
    torch.save({"losses": losses, "parameters": held, "describe": pipe.describe(), "balance": pipe.balance},
               f"{out}/rank{pipe.rank}.pt")
    pipe.save(f"{out}/model.pt")


if __name__ == "__main__":
    main()
