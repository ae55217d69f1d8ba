#!/usr/bin/python3
"""pytorch_compare.py: the workloads of docs/benchmarks.md in Python PyTorch, to set beside `gpipe bench`.

Runs each workload as (a) the plain model on one device with 1 and with 2 intra-op threads, and
(b) torch.distributed.pipeline.sync.Pipe with the same K, M, checkpoint mode and even cut. Prints a
table and writes bench/results/pytorch.json. Needs Debian's python3-torch (run it with
/usr/bin/python3):

    /usr/bin/python3 bench/pytorch_compare.py --workload mlp transformer --stages 2 --micro-batches 32
"""
import argparse, json, os, platform, statistics, sys, tempfile, time

import torch
from torch import nn

from torch_threads import set_threads


def workload(name):
    torch.manual_seed(0)
    if name in ("mlp", "tiny", "imbalanced"):
        widths = {"mlp": [1024] * 17, "tiny": [64] * 9,
                  "imbalanced": [256, 512, 768, 1024, 1280, 1536, 1792, 2048, 2048]}[name]
        batch = {"mlp": 256, "tiny": 256, "imbalanced": 128}[name]
        blocks = [nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in zip(widths, widths[1:])]
        x, y = torch.randn(batch, widths[0]), torch.randn(batch, widths[-1])
        return blocks, None, None, x, y, nn.functional.mse_loss
    if name == "transformer":
        blocks = [nn.TransformerEncoderLayer(256, 8, 1024, dropout=0.0, batch_first=True) for _ in range(8)]
        head, tail = nn.Embedding(2048, 256), nn.Linear(256, 2048)
        x, y = torch.randint(2048, (32, 64)), torch.randint(2048, (32, 64))
        loss = lambda out, t: nn.functional.cross_entropy(out.reshape(-1, out.size(-1)), t.reshape(-1))
        return blocks, head, tail, x, y, loss
    raise SystemExit(f"unknown workload {name!r}; choose mlp, transformer, tiny or imbalanced")


def even_cut(blocks, head, tail, stages):
    """Blocks split evenly; the embedding rides with the first stage, the head with the last (as gpipe)."""
    per, extra = divmod(len(blocks), stages)
    parts, at = [], 0
    for j in range(stages):
        n = per + (1 if j < extra else 0)
        layers = ([head] if j == 0 and head is not None else []) + blocks[at:at + n]
        layers += [tail] if j == stages - 1 and tail is not None else []
        parts.append(nn.Sequential(*layers))
        at += n
    return nn.Sequential(*parts)


def time_steps(step, steps, warmup):
    times = []
    for s in range(warmup + steps):
        begin = time.perf_counter()
        step()
        if s >= warmup:
            times.append(time.perf_counter() - begin)
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", nargs="+", default=["mlp"])
    parser.add_argument("--stages", nargs="+", type=int, default=[2])
    parser.add_argument("--micro-batches", nargs="+", type=int, default=[32])
    parser.add_argument("--checkpoint", nargs="+", default=["except_last"], choices=["always", "except_last", "never"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--results", default="bench/results/pytorch.json")
    args = parser.parse_args()

    from torch.distributed import rpc
    from torch.distributed.pipeline.sync import Pipe
    rpc.init_rpc("worker", rank=0, world_size=1, rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
        init_method="file://" + tempfile.mktemp()))

    rows = []
    print(f"{'workload':12}{'how':>34}{'samples/s':>12}{'(min .. max)':>26}")
    for name in args.workload:
        def report(how, times, batch, **extra):
            rate = batch / statistics.median(times)
            row = {"workload": name, "how": how, "samples_per_s": rate, "samples_per_s_min": batch / max(times),
                   "samples_per_s_max": batch / min(times), **extra}
            rows.append(row)
            span = f"({row['samples_per_s_min']:.1f} .. {row['samples_per_s_max']:.1f})"
            print(f"{name:12}{how:>34}{rate:12.1f}{span:>26}", flush=True)

        for threads in (1, 2):
            set_threads(threads)
            blocks, head, tail, x, y, loss = workload(name)
            model = even_cut(blocks, head, tail, 1)
            sgd = torch.optim.SGD(model.parameters(), lr=1e-4)
            def plain_step():
                sgd.zero_grad(set_to_none=True)
                loss(model(x), y).backward()
                sgd.step()
            report(f"plain model, {threads} thread{'s' if threads > 1 else ''}",
                   time_steps(plain_step, args.steps, args.warmup), x.size(0), threads=threads)
        set_threads(1)
        for K in args.stages:
            for M in args.micro_batches:
                for mode in args.checkpoint:
                    blocks, head, tail, x, y, loss = workload(name)
                    pipe = Pipe(even_cut(blocks, head, tail, K), chunks=M, checkpoint=mode)
                    sgd = torch.optim.SGD(pipe.parameters(), lr=1e-4)
                    def pipe_step():
                        sgd.zero_grad(set_to_none=True)
                        loss(pipe(x).local_value(), y).backward()
                        sgd.step()
                    report(f"Pipe K={K} M={M} {mode}", time_steps(pipe_step, args.steps, args.warmup), x.size(0),
                           stages=K, micro_batches=M, checkpoint=mode, threads_per_device=1)
    rpc.shutdown()

    doc = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "machine": {"cores": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
                       "torch": torch.__version__, "config": torch.__config__.parallel_info().splitlines()[:3]},
           "results": rows}
    os.makedirs(os.path.dirname(args.results) or ".", exist_ok=True)
    tmp = args.results + ".tmp"
    with open(tmp, "w") as out:
        json.dump(doc, out, indent=2)
    os.replace(tmp, args.results)  # whole or not at all
    print(f"results written to {args.results}", file=sys.stderr)


if __name__ == "__main__":
    main()
