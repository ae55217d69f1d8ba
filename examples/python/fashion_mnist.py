#!/usr/bin/python3
"""gpipe train's default job from Python: the CNN on Fashion-MNIST over 2 pipeline devices, with a
torch.utils.data.Dataset over Debian's IDX files, a DataLoader, torch.optim.Adam and the model's own
parameters. Prints the test accuracy after every epoch and gpipe train's summary.

    PYTHONPATH=build/python /usr/bin/python3 examples/python/fashion_mnist.py [--epochs 2]
    mpirun -np 2 env PYTHONPATH=build/python /usr/bin/python3 examples/python/fashion_mnist.py  # a rank per device
"""
import argparse
import gzip
import os

import numpy as np
import torch

import gpipe


class FashionMNIST(torch.utils.data.Dataset):
    """Fashion-MNIST from its gzipped IDX files: images [1, 28, 28] normalized, labels 0..9."""

    MEAN, STD = 0.2860, 0.3530

    def __init__(self, folder, train=True, limit=0):
        split = "train" if train else "t10k"
        images = self._read(os.path.join(folder, f"{split}-images-idx3-ubyte.gz"), 3)
        labels = self._read(os.path.join(folder, f"{split}-labels-idx1-ubyte.gz"), 1)
        if limit:
            images, labels = images[:limit], labels[:limit]
        self.images = (torch.tensor(images, dtype=torch.float32).div_(255).unsqueeze(1) - self.MEAN) / self.STD
        self.labels = torch.tensor(labels, dtype=torch.long)

    @staticmethod
    def _read(path, dims):
        if not os.path.exists(path):
            raise SystemExit(f"{path} is missing: install Debian's dataset-fashion-mnist, or give --data-dir")
        with gzip.open(path, "rb") as f:
            data = f.read()
        sizes = [int.from_bytes(data[4 + 4 * d:8 + 4 * d], "big") for d in range(dims)]
        return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(sizes)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]


def cnn():
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 7 * 7, 256), nn.ReLU(), nn.Dropout(0.3), nn.Linear(256, 10))


def accuracy(pipe, model, loader):
    model.eval()
    correct = 0
    for x, y in loader:
        out = pipe(x)  # under MPI: each replica's last rank holds its replica's rows, the others None
        if out is not None:
            correct += (out.argmax(1) == y[pipe.output_rows(len(y))]).sum().item()
    model.train()
    return pipe.sum(correct) / len(loader.dataset)


def arguments(description, epochs, train_samples=0):
    """The examples' flags: where the data is, how long to train, the batch and M."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--epochs", type=int, default=epochs)
    parser.add_argument("--train-samples", type=int, default=train_samples, help="0: all 60000")
    parser.add_argument("--test-samples", type=int, default=0, help="0: all 10000")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--chunks", type=int, default=4)
    return parser.parse_args()


def loaders(args, drop_last=False):
    """The training set (shuffled, the same order on every rank: seed first) and the test set."""
    train = FashionMNIST(args.data_dir, train=True, limit=args.train_samples)
    test = FashionMNIST(args.data_dir, train=False, limit=args.test_samples)
    return (torch.utils.data.DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=drop_last),
            torch.utils.data.DataLoader(test, batch_size=1000))


def main():
    args = arguments(__doc__.split("\n")[0], epochs=2)
    torch.manual_seed(0)
    loader, test_loader = loaders(args)
    train = loader.dataset

    model = cnn()
    # gpipe train --schedule task: 2 devices, the model as 4 interleaved stages cut {3, 1, 2, 5}, no re-materialization.
    pipe = gpipe.GPipe(model, balance=[3, 1, 2, 5], chunks=args.chunks, schedule="interleaved", checkpoint="never",
                       devices=2)
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-3)  # the model's own parameters (under MPI, this rank's)
    summary = gpipe.Summary(pipe)
    if pipe.rank == 0:
        print(f"gpipe (Python): CNN on Fashion-MNIST, {len(train)} training samples; {pipe.describe()}; "
              f"cut {pipe.balance}, {args.chunks} micro-batches of a batch of {args.batch_size}", flush=True)
    acc = 0.0
    for epoch in range(1, args.epochs + 1):
        # As gpipe train does: each step's Adam update runs on the devices during the next step.
        with pipe.update_on_devices(opt):
            for x, y in loader:
                with summary.step(len(x)):
                    loss = pipe.train_step(x, y, loss="cross_entropy")
        acc = accuracy(pipe, model, test_loader)
        if pipe.rank == 0:
            print(f"epoch {epoch}: loss {loss:.4f}, test accuracy {100 * acc:.2f}%", flush=True)
    summary.print(accuracy=acc)


if __name__ == "__main__":
    main()
