#!/usr/bin/python3
"""torchvision's ResNet-18 as torchvision builds it, trained unchanged through gpipe: not a Sequential
(its forward calls torch.flatten), ReLU(inplace=True) everywhere, BatchNorm inside every block.
GPipe traces it with torch.fx, cuts it into pieces over 2 devices on the first batch, and defers
the BatchNorms' running statistics to the end of each mini-batch. Trains on Fashion-MNIST (each
image's one channel given as torchvision's three) with SGD; prints the test accuracy after every
epoch and gpipe train's summary. ResNet-18 is 11M parameters: by default 5000 training samples.

    PYTHONPATH=build/python /usr/bin/python3 examples/python/torchvision_resnet.py [--train-samples 60000]
"""
import os
import sys

import torch
import torchvision

import gpipe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fashion_mnist import FashionMNIST, accuracy, arguments  # noqa: E402


class ThreeChannels(FashionMNIST):
    """Fashion-MNIST's images as the three channels torchvision's models take."""

    def __getitem__(self, i):
        image, label = super().__getitem__(i)
        return image.expand(3, -1, -1), label


def main():
    args = arguments(__doc__.split("\n")[0], epochs=1, train_samples=5000)
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(ThreeChannels(args.data_dir, limit=args.train_samples),
                                         batch_size=args.batch_size, shuffle=True, drop_last=True)
    test_loader = torch.utils.data.DataLoader(ThreeChannels(args.data_dir, train=False, limit=args.test_samples),
                                              batch_size=500)

    model = torchvision.models.resnet18(num_classes=10)
    pipe = gpipe.GPipe(model, chunks=args.chunks, devices=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    summary = gpipe.Summary(pipe)
    acc = 0.0
    for epoch in range(1, args.epochs + 1):
        for x, y in loader:
            with summary.step(len(x)):
                opt.zero_grad()
                loss = pipe.train_step(x, y, loss="cross_entropy")
                opt.step()
            if summary.steps == 1 and pipe.rank == 0:
                print(f"gpipe (Python): torchvision's ResNet-18 in {len(pipe.pieces)} pieces, {pipe.describe()}: "
                      f"{pipe.schedule}, cut {pipe.balance}, {pipe.chunks} micro-batches", flush=True)
        acc = accuracy(pipe, model, test_loader)
        if pipe.rank == 0:
            print(f"epoch {epoch}: loss {loss:.4f}, test accuracy {100 * acc:.2f}%", flush=True)
    summary.print(accuracy=acc)


if __name__ == "__main__":
    main()
