#!/usr/bin/python3
"""A Transformer language model from Python through gpipe: a character-level model of English text
(by default the GNU GPL's text, which every Debian machine has), an embedding, causal encoder
blocks and a projection to the characters, cut over 2 pipeline devices, trained with AdamW. Prints
the held-out loss after every epoch, a sample of generated text, and gpipe train's summary.

    PYTHONPATH=build/python /usr/bin/python3 examples/python/transformer.py [--epochs 2] [--text FILE]
"""
import argparse
import math

import torch

import gpipe


class Embed(torch.nn.Module):
    """Characters to vectors, plus a learned position embedding."""

    def __init__(self, vocab: int, width: int, length: int):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, width)
        self.positions = torch.nn.Parameter(torch.zeros(length, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tokens(x) + self.positions[: x.size(1)]


class Block(torch.nn.Module):
    """A pre-norm Transformer encoder block that sees only earlier positions (causal)."""

    def __init__(self, width: int, heads: int, ffn: int):
        super().__init__()
        self.layer = torch.nn.TransformerEncoderLayer(width, heads, ffn, dropout=0.0, batch_first=True,
                                                      norm_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.size(1)
        causal = torch.triu(torch.full((n, n), float("-inf"), device=x.device), diagonal=1)
        return self.layer(x, src_mask=causal)


def language_model(vocab, width=128, heads=4, ffn=512, blocks=4, length=64):
    return torch.nn.Sequential(Embed(vocab, width, length), *[Block(width, heads, ffn) for _ in range(blocks)],
                               torch.nn.LayerNorm(width), torch.nn.Linear(width, vocab))


def windows(ids, length, step):
    """Every window of length+1 characters, `step` apart: inputs and the next characters."""
    starts = torch.arange(0, len(ids) - length - 1, step)
    rows = torch.stack([ids[s:s + length + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def text_data(path, length, batch_size):
    """The characters of the text at `path`, its ids, a loader of windows of 90% of it (inputs and the
    next characters, shuffled) and the held-out windows of the rest."""
    text = open(path, encoding="utf-8", errors="replace").read()
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text])
    cut = len(ids) * 9 // 10
    x, y = windows(ids[:cut], length, length // 2)
    held_x, held_y = windows(ids[cut:], length, length)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size,
                                         shuffle=True, drop_last=True)
    return chars, ids, loader, held_x, held_y


def held_out_loss(pipe, model, held_x, held_y, vocab):
    """The mean cross-entropy per character of the held-out windows, through the pipeline in eval mode
    (under mpirun: each replica's last rank holds its rows, summed over the ranks)."""
    model.eval()
    out = pipe(held_x)
    rows = held_y[pipe.output_rows(len(held_y))]
    total = pipe.sum(0.0 if out is None else torch.nn.functional.cross_entropy(
        out.reshape(-1, vocab), rows.reshape(-1), reduction="sum").item())
    model.train()
    return total / held_y.numel()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--schedule", default="1f1b", choices=gpipe.schedule_names())
    args = parser.parse_args()

    chars, ids, loader, held_x, held_y = text_data(args.text, args.length, args.batch_size)

    torch.manual_seed(0)
    model = language_model(len(chars), length=args.length)
    # 7 layers: the embedding and 2 blocks on device 0, 2 blocks, the norm and the projection on device 1.
    pipe = gpipe.GPipe(model, balance=[3, 4], chunks=args.chunks, schedule=args.schedule, devices=2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    summary = gpipe.Summary(pipe)
    if pipe.rank == 0:
        print(f"gpipe (Python): a {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M-parameter Transformer on "
              f"{len(ids)} characters of {args.text}; {pipe.describe()}, {args.schedule}, cut {pipe.balance}",
              flush=True)
    held = 0.0
    for epoch in range(1, args.epochs + 1):
        for xb, yb in loader:
            with summary.step(len(xb)):
                opt.zero_grad()
                loss = pipe.train_step(xb, yb, loss="cross_entropy")  # over every position
                pipe.clip_grad_norm_(1.0)  # the norm over every rank's gradients under mpirun
                opt.step()
        held = held_out_loss(pipe, model, held_x, held_y, len(chars))
        if pipe.rank == 0:
            print(f"epoch {epoch}: loss {loss:.4f}, held-out loss {held:.4f} ({math.exp(held):.2f} perplexity)",
                  flush=True)
    # Greedy continuation of the text's first words, through the pipeline (under mpirun every rank
    # takes the next character from the rank that holds the output).
    model.eval()
    context = ids[:args.length // 2].tolist()
    for _ in range(80):
        out = pipe(torch.tensor([context[-args.length:]]))
        context.append(int(pipe.sum(0 if out is None else int(out[0, -1].argmax()))))
    if pipe.rank == 0:
        print("sample: " + repr("".join(chars[i] for i in context)))
    summary.print(loss=held, evaluated_on="held-out")


if __name__ == "__main__":
    main()
