#!/usr/bin/python3
"""pytorch_train.py: gpipe train's default job in plain PyTorch, to set beside it.

The same CNN as `gpipe train` (two convolution blocks and a classifier), Adam with rate 1e-3,
batches of 128 drawn from a shuffled Fashion-MNIST (Debian's dataset-fashion-mnist), the whole
model on one device with --threads intra-op and OpenBLAS threads. Prints one JSON object: the
samples per second of the training steps (forward, backward, optimizer step; batch gathering
left out, as gpipe train counts them), their median step time and the final loss. Needs
Debian's python3-torch: run it with /usr/bin/python3.

    /usr/bin/python3 bench/pytorch_train.py --threads 2 --train-samples 12800
"""
import argparse, gzip, json, os, statistics, time

import numpy as np
import torch
from torch import nn

from torch_threads import set_threads


def read_idx(path, dims):
    with gzip.open(path, "rb") as f:
        data = f.read()
    sizes = [int.from_bytes(data[4 + 4 * d:8 + 4 * d], "big") for d in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(sizes)


def load(folder, limit):
    images = read_idx(os.path.join(folder, "train-images-idx3-ubyte.gz"), 3)[:limit or None]
    labels = read_idx(os.path.join(folder, "train-labels-idx1-ubyte.gz"), 1)[:limit or None]
    x = torch.tensor(images, dtype=torch.float32).div_(255).unsqueeze(1)
    x = (x - x.mean()) / x.std()
    return x, torch.tensor(labels, dtype=torch.long)


def cnn():
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 7 * 7, 256), nn.ReLU(), nn.Dropout(0.3), nn.Linear(256, 10))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--train-samples", type=int, default=12800, help="0: all 60000")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    set_threads(args.threads)
    torch.manual_seed(args.seed)
    x, y = load(args.data_dir, args.train_samples)
    model = cnn()
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    shuffle = torch.Generator().manual_seed(args.seed)
    step_s, loss = [], float("nan")
    for _ in range(args.epochs):
        order = torch.randperm(len(x), generator=shuffle)
        for at in range(0, len(x), args.batch_size):
            rows = order[at:at + args.batch_size]
            xb, yb = x[rows], y[rows]
            begin = time.perf_counter()
            adam.zero_grad()
            out = nn.functional.cross_entropy(model(xb), yb)
            out.backward()
            adam.step()
            step_s.append(time.perf_counter() - begin)
            loss = out.item()
    samples = len(x) * args.epochs
    print(json.dumps({"threads": args.threads, "samples": samples, "train_seconds": sum(step_s),
                      "samples_per_s": samples / sum(step_s), "median_step_s": statistics.median(step_s),
                      "final_loss": loss, "torch": torch.__version__,
                      "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}}))


if __name__ == "__main__":
    main()
