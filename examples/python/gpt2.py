#!/usr/bin/python3
"""A GPT-2-style language model written as PyTorch users write one, trained unchanged through gpipe:
its blocks in a ModuleList run by a loop in forward, `B, T, C = x.size()` in the attention, a
causal mask kept as a buffer, and an output head tied to the token embedding. GPipe traces it
with torch.fx, cuts it between any two layers where only tensors cross, and pipelines it over 2
devices. Trains a character-level model of English text (by default the GNU GPL's text, which
every Debian machine has) with AdamW; prints the held-out loss after every epoch, a sample of
generated text, and gpipe train's summary.

    PYTHONPATH=build/python /usr/bin/python3 examples/python/gpt2.py [--epochs 1] [--text FILE]
"""
import argparse
import math
import os
import sys
import time

import torch
import torch.nn as nn
from torch.nn import functional as F

import gpipe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from transformer import held_out_loss, text_data  # noqa: E402


class CausalSelfAttention(nn.Module):
    def __init__(self, width, heads, length):
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.heads = heads
        self.register_buffer("mask", torch.tril(torch.ones(length, length)).view(1, 1, length, length))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, width, heads, length):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, length)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab, width=128, heads=4, blocks=4, length=64):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(length, width)
        self.blocks = nn.ModuleList([Block(width, heads, length) for _ in range(blocks)])
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied: one weight, read by the first and the last layer

    def forward(self, idx):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    chars, ids, loader, held_x, held_y = text_data(args.text, args.length, args.batch_size)

    torch.manual_seed(0)
    model = GPT(len(chars), length=args.length)
    begin = time.perf_counter()
    pipe = gpipe.GPipe(model, devices=2)  # traced now; cut, and its schedule chosen, on the first batch
    traced = time.perf_counter() - begin
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    summary = gpipe.Summary(pipe)
    held = 0.0
    for epoch in range(1, args.epochs + 1):
        for xb, yb in loader:
            with summary.step(len(xb)):
                opt.zero_grad()
                loss = pipe.train_step(xb, yb, loss="cross_entropy")  # over every position
                opt.step()
            if pipe.rank == 0 and summary.steps == 1:
                print(f"gpipe (Python): a {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M-parameter GPT "
                      f"traced in {traced:.2f} s, cut into {len(pipe.pieces)} pieces and {pipe.describe()}: "
                      f"{pipe.schedule}, cut {pipe.balance}, {pipe.chunks} micro-batches (chosen and built in "
                      f"{pipe.build_seconds:.2f} s)", flush=True)
        held = held_out_loss(pipe, model, held_x, held_y, len(chars))
        if pipe.rank == 0:
            print(f"epoch {epoch}: loss {loss:.4f}, held-out loss {held:.4f} ({math.exp(held):.2f} perplexity)",
                  flush=True)
    # The model is the user's own: model(x) runs it directly, as PyTorch would.
    model.eval()
    context = ids[:args.length // 2].tolist()
    with torch.no_grad():
        for _ in range(80):
            context.append(int(model(torch.tensor([context[-args.length:]]))[0, -1].argmax()))
    if pipe.rank == 0:
        print("sample: " + repr("".join(chars[i] for i in context)))
    summary.print(loss=held, evaluated_on="held-out")


if __name__ == "__main__":
    main()
