#!/usr/bin/python3
"""gpt_pytorch.py: gpipe train --model gpt's default job in plain PyTorch, to set beside it.

The same byte-level GPT as `gpipe train --model gpt` (src/model/models.cc: an embedding of bytes
plus learned positions, pre-LayerNorm blocks of causal self-attention and a GELU MLP, a final
LayerNorm, the head tied to the byte embedding), trained on the same windows of Debian's fortunes
(the training part of each file, docs/models.md) with the same batch, Adam and cosine learning
rate, the whole model on one device with --threads intra-op and OpenBLAS threads. Prints one JSON
object: the samples (windows) per second of the training steps (forward, backward, optimizer
step; batch gathering left out, as gpipe train counts them), the median step time, the final
loss, and with --evaluate the test bits per byte. Needs Debian's python3-torch: run it with
/usr/bin/python3.

    /usr/bin/python3 bench/gpt_pytorch.py --threads 1 --steps 40
"""
import argparse, json, math, os, statistics, time

import torch
from torch import nn

from torch_threads import set_threads


def load_fortunes(folder):
    """The training and test bytes, split as gpipe's load_fortunes splits them."""
    names = sorted(n for n in os.listdir(folder)
                   if "." not in n and not os.path.islink(os.path.join(folder, n))
                   and os.path.isfile(os.path.join(folder, n)))
    train, test = bytearray(), bytearray()
    for name in names:
        with open(os.path.join(folder, name), "rb") as f:
            text = f.read()
        tenth = len(text) - len(text) // 10
        mark = text.find(b"\n%\n", tenth - 3) if tenth >= 3 else -1
        cut = len(text) if mark < 0 else mark + 3
        train += text[:cut]
        test += text[cut:]
    return bytes(train), bytes(test)


def windows(text, length):
    data = torch.tensor(list(text), dtype=torch.long)
    n = (len(data) - 1) // length
    return data[:n * length].view(n, length), data[1:n * length + 1].view(n, length)


class Block(nn.Module):
    def __init__(self, width, heads, feed_forward, blocks):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, feed_forward), nn.Linear(feed_forward, width)
        for layer, std in ((self.qkv, 0.02), (self.proj, 0.02 / math.sqrt(2 * blocks)), (self.up, 0.02),
                           (self.down, 0.02 / math.sqrt(2 * blocks))):
            nn.init.normal_(layer.weight, 0.0, std)
            nn.init.zeros_(layer.bias)

    def forward(self, x):
        n, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln1(x)).view(n, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // h)
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        y = x + self.proj((torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(n, t, d))
        return y + self.down(nn.functional.gelu(self.up(self.ln2(y))))


class Gpt(nn.Module):
    def __init__(self, context, width, heads, blocks, feed_forward):
        super().__init__()
        self.bytes = nn.Embedding(256, width)
        self.positions = nn.Parameter(torch.empty(context, width))
        nn.init.normal_(self.bytes.weight, 0.0, 0.02)
        nn.init.normal_(self.positions, 0.0, 0.02)
        self.blocks = nn.Sequential(*[Block(width, heads, feed_forward, blocks) for _ in range(blocks)])
        self.ln = nn.LayerNorm(width)
        self.bias = nn.Parameter(torch.zeros(256))

    def forward(self, x):
        h = self.bytes(x) + self.positions[:x.shape[1]]
        return nn.functional.linear(self.ln(self.blocks(h)), self.bytes.weight, self.bias)


def loss_of(model, x, y):
    out = model(x)
    return nn.functional.cross_entropy(out.reshape(-1, 256), y.reshape(-1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", default="/usr/share/games/fortunes")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--feed-forward", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--epochs", type=int, default=1, help="the run the cosine schedule spans")
    parser.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: all epochs)")
    parser.add_argument("--evaluate", action="store_true", help="report the test bits per byte at the end")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    set_threads(args.threads)
    torch.manual_seed(args.seed)
    train, test = load_fortunes(args.data_dir)
    x, y = windows(train, args.context)
    model = Gpt(args.context, args.width, args.heads, args.blocks, args.feed_forward)
    adam = torch.optim.Adam(model.parameters(), lr=args.lr)
    steps_per_epoch = (len(x) + args.batch_size - 1) // args.batch_size
    total = steps_per_epoch * args.epochs
    shuffle = torch.Generator().manual_seed(args.seed)
    step_s, loss, step = [], float("nan"), 0
    for _ in range(args.epochs):
        order = torch.randperm(len(x), generator=shuffle)
        for at in range(0, len(x), args.batch_size):
            if args.steps and step >= args.steps:
                break
            rows = order[at:at + args.batch_size]
            xb, yb = x[rows], y[rows]
            begin = time.perf_counter()
            for group in adam.param_groups:  # cosine from lr down to 0 over the run, as gpipe's
                group["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * step / total))
            adam.zero_grad()
            out = loss_of(model, xb, yb)
            out.backward()
            adam.step()
            step_s.append(time.perf_counter() - begin)
            loss = out.item()
            step += 1
    result = {"threads": args.threads, "steps": step, "samples": step * args.batch_size,
              "train_seconds": sum(step_s), "samples_per_s": step * args.batch_size / sum(step_s),
              "median_step_s": statistics.median(step_s), "final_loss": loss, "torch": torch.__version__,
              "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}}
    if args.evaluate:
        tx, ty = windows(test, args.context)
        with torch.no_grad():
            total_loss = sum(loss_of(model, tx[at:at + 256], ty[at:at + 256]).item() * len(tx[at:at + 256])
                             for at in range(0, len(tx), 256))
        result["test_bits_per_byte"] = total_loss / len(tx) / math.log(2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
