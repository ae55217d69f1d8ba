#!/usr/bin/python3
"""The ResNet of `gpipe train --model resnet` from Python: residual blocks with BatchNorm whose
shortcuts are skip connections (gpipe.Stash / gpipe.Pop) that cross pipeline stages, cut by measured
time, trained on Fashion-MNIST with SGD, a cosine learning rate (torch.optim.lr_scheduler) and
left-right flips. Prints the test accuracy after every epoch and gpipe train's summary.

    PYTHONPATH=build/python /usr/bin/python3 examples/python/resnet.py [--epochs 1]
"""
import os
import sys

import torch

import gpipe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fashion_mnist import accuracy, arguments, loaders  # noqa: E402


class Shortcut(torch.nn.Module):
    """A block's shortcut to half the pixels and more channels: every other pixel, new channels zero."""

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.pad(skip[:, :, ::2, ::2], [0, 0, 0, 0, 0, x.size(1) - skip.size(1)])


def resnet():
    """30 layers, flat: a stem, 3 residual blocks of 32, 64 and 128 channels, a head (gpipe::fashion_resnet)."""
    nn = torch.nn
    layers = [nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU()]
    width_in = 16
    for width in (32, 64, 128):
        name = f"block{width}"
        layers += [gpipe.Stash(name), nn.Conv2d(width_in, width, 3, stride=2, padding=1, bias=False),
                   nn.BatchNorm2d(width), nn.ReLU(), nn.Conv2d(width, width, 3, padding=1, bias=False),
                   nn.BatchNorm2d(width), gpipe.Pop(name, Shortcut()), nn.ReLU()]
        width_in = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10)]
    return nn.Sequential(*layers)


def main():
    args = arguments(__doc__.split("\n")[0], epochs=1)
    torch.manual_seed(0)
    loader, test_loader = loaders(args, drop_last=True)

    model = resnet()
    # No balance: cut by each layer's measured time on the first micro-batch (the blocks differ 10x).
    pipe = gpipe.GPipe(model, chunks=args.chunks, devices=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))
    summary = gpipe.Summary(pipe)
    acc = 0.0
    for epoch in range(1, args.epochs + 1):
        for x, y in loader:
            flip = torch.rand(len(x)) < 0.5
            x = torch.where(flip[:, None, None, None], x.flip(3), x)
            with summary.step(len(x)):
                opt.zero_grad()
                loss = pipe.train_step(x, y, loss="cross_entropy")
                opt.step()
            schedule.step()
        if epoch == 1 and pipe.rank == 0:
            print(f"gpipe (Python): ResNet on Fashion-MNIST, {pipe.describe()}, cut by time {pipe.balance}", flush=True)
        acc = accuracy(pipe, model, test_loader)
        if pipe.rank == 0:
            print(f"epoch {epoch}: loss {loss:.4f}, test accuracy {100 * acc:.2f}%", flush=True)
    summary.print(accuracy=acc)


if __name__ == "__main__":
    main()
