#!/usr/bin/env python3
"""device_pytorch.py: plain PyTorch's samples/s for the GPU Transformer of `device_bench gpu`, on the same GPU.

The same model, batch and optimizer as gpipe's K = 1: an embedding, L post-norm encoder blocks
(self-attention and a ReLU feed-forward, no dropout), a projection to the vocabulary, cross-entropy,
Adam (lr 1e-4), in float32 and (--precision bf16) under torch.autocast to bfloat16, as gpipe's
--precision bf16 runs it. Two attentions:
  explicit  the attention as libtorch's C++ TransformerEncoderLayer computes it (q·kᵀ, softmax, ·v):
            the same arithmetic as gpipe's model, the comparison `gpu_vs_pytorch` takes;
  sdpa      torch.nn.TransformerEncoderLayer (scaled_dot_product_attention, fused kernels), what a
            PyTorch user writes: reported beside it.
Prints one JSON object per attention and precision. Usage (bench/device.sh runs it):
    python3 bench/device_pytorch.py --layers 24 --width 1024 --heads 16 --ffn 4096 --sequence 512 --batch 32
"""
import argparse, contextlib, json, math, statistics, sys, time

import torch
from torch import nn
import torch.nn.functional as F


class ExplicitBlock(nn.Module):
    """Post-norm encoder block with the attention spelled out, as libtorch's C++ layer runs it."""

    def __init__(self, width, heads, ffn):
        super().__init__()
        self.heads = heads
        self.in_proj = nn.Linear(width, 3 * width)
        self.out_proj = nn.Linear(width, width)
        self.linear1, self.linear2 = nn.Linear(width, ffn), nn.Linear(ffn, width)
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)

    def forward(self, x):  # [batch, sequence, width]
        n, s, d = x.shape
        h = self.heads
        q, k, v = self.in_proj(x).chunk(3, dim=-1)
        q, k, v = (t.reshape(n, s, h, d // h).transpose(1, 2).reshape(n * h, s, d // h) for t in (q, k, v))
        weights = torch.softmax(torch.bmm(q / math.sqrt(d // h), k.transpose(1, 2)), dim=-1)
        a = torch.bmm(weights, v).reshape(n, h, s, d // h).transpose(1, 2).reshape(n, s, d)
        x = self.norm1(x + self.out_proj(a))
        return self.norm2(x + self.linear2(F.relu(self.linear1(x))))


def model(args, attention):
    torch.manual_seed(0)
    if attention == "explicit":
        blocks = [ExplicitBlock(args.width, args.heads, args.ffn) for _ in range(args.layers)]
    else:
        blocks = [nn.TransformerEncoderLayer(args.width, args.heads, args.ffn, dropout=0.0, batch_first=True)
                  for _ in range(args.layers)]
    return nn.Sequential(nn.Embedding(args.vocab, args.width), *blocks, nn.Linear(args.width, args.vocab))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in [("layers", 24), ("width", 1024), ("heads", 16), ("ffn", 4096), ("sequence", 512),
                          ("batch", 32), ("vocab", 32000), ("steps", 5), ("warmup", 2)]:
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--attention", nargs="+", default=["explicit", "sdpa"], choices=["explicit", "sdpa"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: device.sh's smoke test")
    p.add_argument("--precision", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"kind": "pytorch_skipped", "why": "no CUDA device visible"}))
        return 0
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    cuda = args.device == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    for precision, attention in ((p, a) for p in args.precision for a in args.attention):
        autocast = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" \
            else contextlib.nullcontext()
        m = model(args, attention).to(device)
        adam = torch.optim.Adam(m.parameters(), lr=1e-4)
        torch.manual_seed(1)
        x = torch.randint(args.vocab, (args.batch, args.sequence), device=device)
        y = torch.randint(args.vocab, (args.batch, args.sequence), device=device)
        times = []
        for step in range(args.warmup + args.steps):
            if cuda:
                torch.cuda.synchronize()
            begin = time.perf_counter()
            adam.zero_grad()
            with autocast:
                out = m(x)
                loss = F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))
            loss.backward()
            adam.step()
            if cuda:
                torch.cuda.synchronize()
            if step >= args.warmup:
                times.append(time.perf_counter() - begin)
        seconds = statistics.median(times)
        print(json.dumps({"kind": "pytorch", "device": str(device), "precision": precision, "attention": attention,
                          "step_s": seconds,
                          "samples_per_s": args.batch / seconds,
                          "parameters": sum(p.numel() for p in m.parameters()),
                          "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None}), flush=True)
        del m, adam, out, loss
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
