#!/usr/bin/python3
"""python_compare.py: gpipe's Python package against plain PyTorch, torch's Pipe and `gpipe train`.

Each contender runs in a process of its own (so that no thread pool, allocator arena or spinning
worker of one slows another), and the driver alternates them step by step: one training step of
each in turn, every ratio a per-step ratio of steps taken moments apart on a noisy machine; the
median of the ratios is reported with its min and max. Results: bench/results/python-compare.json.

  cnn          the main job's CNN (Fashion-MNIST, batches of 128, Adam): gpipe.GPipe(model, devices=2)
               with its defaults (schedule, M and cut chosen by prediction) and Adam's update on the
               devices (update_on_devices), against the same model in plain PyTorch on 2 threads and
               on 1.
  cli          one epoch each per round (the CLI cannot be stepped from outside, so rounds), as
               bench/train_vs_pytorch.sh measures the main job: `gpipe train` with its defaults,
               gpipe.GPipe(model, devices=2) with its defaults and Adam's update on the devices,
               and the same model in plain PyTorch on one thread; gpipe.GPipe's samples/s over
               `gpipe train`'s, and each one's fraction of the 2-core limit (twice plain
               PyTorch's rate on one thread), per round.
  traced       models as their authors wrote them, traced and cut by gpipe.GPipe(model, devices=2) with
               its defaults: torchvision's ResNet-18 at 32x32 (batches of 64, SGD) and
               examples/python/gpt2.py's GPT-2-style model (batches of 32 sequences of 64, AdamW),
               each against itself in plain PyTorch on 2 threads and on 1, alternated step by step;
               with the seconds gpipe took to trace the model and to cut it into pieces (compiled).
  transformer  docs/benchmarks.md's transformer at K=2, M=8, checkpoint except_last: gpipe.GPipe
               against torch.distributed.pipeline.sync.Pipe; and the share of gpipe's step time
               spent holding the GIL. Pipe needs torch's RPC, whose TensorPipe agent keeps a core
               busy polling even while it waits (measured here: 100% of a core, and gpipe 13.4 ->
               11.7 samples/s beside an idle one), so the two cannot wait beside each other: they
               alternate in rounds, one process at a time, and the ratio is per round.

The PyTorch contenders run with the malloc settings gpipe gives itself (gpipe::keep_freed_memory).
Needs Debian's python3-torch and the built package:

    PYTHONPATH=build/python /usr/bin/python3 bench/python_compare.py [--steps 100] [--rounds 5]
"""
import argparse, json, os, platform, statistics, subprocess, sys, tempfile, time

from torch_threads import set_threads

HERE = os.path.dirname(os.path.abspath(__file__))
KEPT_MALLOC = {"MALLOC_TRIM_THRESHOLD_": "268435456", "MALLOC_MMAP_THRESHOLD_": "33554432",
               "MALLOC_TOP_PAD_": "67108864"}


def contender(name, args):
    """The contender `name`: a function that runs one training step, and one that tells the GIL share."""
    import torch
    from torch import nn
    import gpipe
    sys.path.insert(0, os.path.join(HERE, "..", "examples", "python"))
    if name.startswith("cnn"):
        from fashion_mnist import FashionMNIST, cnn
        torch.manual_seed(0)
        data = FashionMNIST(args.data_dir, train=True, limit=args.samples)
        batches = list(torch.utils.data.DataLoader(data, batch_size=128, shuffle=True, drop_last=True))
        model = cnn()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        pipe = block = None
        if name == "cnn gpipe":
            pipe = gpipe.GPipe(model, devices=2)
            block = pipe.update_on_devices(opt)  # entered for the process's life (kept: its exit applies the update)
            block.__enter__()
        else:
            set_threads(int(name.split()[-1]))
        at = [0]

        def step():
            x, y = batches[at[0] % len(batches)]
            at[0] += 1
            if block is not None:
                pipe.train_step(x, y)  # and Adam's step, on the devices
            else:
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
        return step, (lambda: pipe.gil_share) if pipe else None

    if name.split()[0] in ("resnet18", "gpt2"):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        if name.startswith("resnet18"):
            import torchvision
            model = torchvision.models.resnet18(num_classes=10)
            batches = [(torch.randn(64, 3, 32, 32, generator=g), torch.randint(10, (64,), generator=g))
                       for _ in range(8)]
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        else:
            from gpt2 import GPT
            model = GPT(96, length=64)
            batches = [(torch.randint(96, (32, 64), generator=g), torch.randint(96, (32, 64), generator=g))
                       for _ in range(8)]
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        pipe = gpipe.GPipe(model, devices=2) if name.endswith("gpipe") else None
        if pipe is None:
            set_threads(int(name.split()[-1]))
        at = [0]

        def step():
            x, y = batches[at[0] % len(batches)]
            at[0] += 1
            opt.zero_grad()
            if pipe is not None:
                pipe.train_step(x, y)
            else:
                out = model(x)
                nn.functional.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1)).backward()
            opt.step()
        if pipe is None:
            return step, None
        return step, lambda: {"gil_share": pipe.gil_share, "trace_s": pipe._trace_seconds,
                              "split_s": getattr(pipe, "_split_seconds", None), "schedule": pipe.schedule,
                              "chunks": pipe.chunks, "balance": pipe.balance,
                              "pieces": None if pipe.pieces is None else len(pipe.pieces)}

    torch.manual_seed(0)
    layers = [nn.Embedding(2048, 256), *[nn.TransformerEncoderLayer(256, 8, 1024, dropout=0.0, batch_first=True)
                                         for _ in range(8)], nn.Linear(256, 2048)]
    x, y = torch.randint(2048, (32, 64)), torch.randint(2048, (32, 64))
    set_threads(1)
    if name == "transformer gpipe":
        model = nn.Sequential(*layers)
        pipe = gpipe.GPipe(model, balance=[5, 5], chunks=8, checkpoint="except_last", schedule="gpipe", devices=2)
        sgd = torch.optim.SGD(model.parameters(), lr=1e-4)

        def step():
            sgd.zero_grad()
            pipe.train_step(x, y)
            sgd.step()
        return step, lambda: pipe.gil_share
    from torch.distributed import rpc
    from torch.distributed.pipeline.sync import Pipe
    rpc.init_rpc("worker", rank=0, world_size=1, rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
        init_method="file://" + tempfile.mktemp()))
    pipe = Pipe(nn.Sequential(nn.Sequential(*layers[:5]), nn.Sequential(*layers[5:])), chunks=8,
                checkpoint="except_last")
    sgd = torch.optim.SGD(pipe.parameters(), lr=1e-4)

    def step():
        sgd.zero_grad()
        out = pipe(x).local_value()
        nn.functional.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1)).backward()
        sgd.step()
    return step, None


def worker(name, args):
    """Runs contender `name` one step per "step" line on standard input; answers the step's seconds."""
    step, gil = contender(name, args)
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        begin = time.perf_counter()
        step()
        seconds = time.perf_counter() - begin
        print(json.dumps({"seconds": seconds, "gil_share": gil() if gil else None}), flush=True)  # or gpipe's info


def alternate(names, steps, warmup, args):
    """Steps of every contender in turn, each in its process; per contender its timed steps."""
    procs = {}
    for name in names:
        env = dict(os.environ, **({} if "gpipe" in name else KEPT_MALLOC))
        procs[name] = subprocess.Popen([sys.executable, __file__, "--worker", name, "--samples", str(args.samples),
                                        "--data-dir", args.data_dir], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       env=env, text=True)
        line = procs[name].stdout.readline()
        assert line.strip() == "ready", f"{name}: {line!r}"
    results = {name: [] for name in names}
    for s in range(warmup + steps):
        for name, p in procs.items():
            p.stdin.write("step\n")
            p.stdin.flush()
            answer = json.loads(p.stdout.readline())
            if s >= warmup:
                results[name].append(answer)
    for p in procs.values():
        p.stdin.close()
        p.wait()
    return results


def rounds(names, steps, warmup, count, args):
    """`count` rounds of `steps` steps of each contender in turn, one process at a time; per contender,
    the median step of each round."""
    medians = {name: [] for name in names}
    answers = {name: [] for name in names}
    for _ in range(count):
        for name in names:
            result = alternate([name], steps, warmup, args)[name]
            medians[name].append(statistics.median(r["seconds"] for r in result))
            answers[name] += result
    return medians, answers


def ratios(a, b):
    r = [x / y for x, y in zip(a, b)]
    return {"median": statistics.median(r), "min": min(r), "max": max(r)}


def span(r):
    return f"x{r['median']:.3f} ({r['min']:.3f} .. {r['max']:.3f})"


def cnn(args):
    names = ["cnn gpipe", "cnn pytorch 2", "cnn pytorch 1"]
    results = alternate(names, args.steps, args.warmup, args)
    seconds = {n: [r["seconds"] for r in results[n]] for n in names}
    rows = []
    for name in names:
        row = {"comparison": "cnn", "contender": name, "samples_per_s": 128 / statistics.median(seconds[name]),
               "steps": len(seconds[name]), "gpipe_speedup_per_step": ratios(seconds[name], seconds["cnn gpipe"])}
        rows.append(row)
        print(f"cnn  {name:15s} {row['samples_per_s']:7.0f} samples/s   gpipe.GPipe K=2 "
              f"{span(row['gpipe_speedup_per_step'])} per step", flush=True)
    # The fraction of the 2-core limit: twice plain PyTorch's rate on one core, per step.
    one_thread = next(r for r in rows if r["contender"] == "cnn pytorch 1")
    limit = {k: v / 2 for k, v in one_thread["gpipe_speedup_per_step"].items()}
    rows[0]["of_2_core_limit"] = limit
    print(f"cnn  gpipe.GPipe: {span(limit)} of the 2-core limit per step", flush=True)
    return rows


def cli(args):
    import_path = os.environ.get("PYTHONPATH", "")
    rates = {"gpipe_train": [], "gpipe_python": [], "pytorch_1_thread": []}
    choices = []  # gpipe.GPipe's, per round: schedule="auto" may choose differently
    for r in range(args.rounds):
        out = subprocess.run([args.gpipe, "train", "--train-samples", str(args.samples), "--test-samples", "500",
                              "--epochs", "1", "--json"], capture_output=True, text=True, check=True).stdout
        rates["gpipe_train"].append(json.loads(out)["samples_per_s"])
        for contender, name in (("gpipe", "gpipe_python"), ("pytorch", "pytorch_1_thread")):
            env = dict(os.environ, PYTHONPATH=import_path, **(KEPT_MALLOC if contender == "pytorch" else {}))
            out = subprocess.run([sys.executable, __file__, "--epoch", contender, "--samples", str(args.samples),
                                  "--data-dir", args.data_dir], capture_output=True, text=True, check=True,
                                 env=env).stdout
            answer = json.loads(out.strip().splitlines()[-1])
            rates[name].append(answer["samples_per_s"])
            if contender == "gpipe":
                choices.append({k: answer[k] for k in ("schedule", "chunks", "balance")})
        print(f"cli  round {r + 1}: " + ", ".join(f"{name} {values[-1]:.0f}" for name, values in rates.items()) +
              f" samples/s; gpipe.GPipe ran {choices[-1]}", flush=True)
    limit = [2 * x for x in rates["pytorch_1_thread"]]
    row = {"comparison": "cli", "gpipe_train_samples_per_s": statistics.median(rates["gpipe_train"]),
           "python_samples_per_s": statistics.median(rates["gpipe_python"]),
           "pytorch_1_thread_samples_per_s": statistics.median(rates["pytorch_1_thread"]),
           "python_over_gpipe_train": ratios(rates["gpipe_python"], rates["gpipe_train"]),
           "python_of_2_core_limit": ratios(rates["gpipe_python"], limit),
           "gpipe_train_of_2_core_limit": ratios(rates["gpipe_train"], limit),
           "rounds": args.rounds, "per_round": rates, "python_choices": choices}
    print(f"cli  gpipe.GPipe / gpipe train {span(row['python_over_gpipe_train'])} per round")
    print(f"cli  of the 2-core limit: gpipe.GPipe {span(row['python_of_2_core_limit'])}, gpipe train "
          f"{span(row['gpipe_train_of_2_core_limit'])} per round")
    return [row]


def epoch(args):
    """One epoch of the CNN, its steps timed as `gpipe train` times them; prints JSON. `args.epoch`:
    "gpipe", gpipe.GPipe with its defaults and the update on the devices; "pytorch", plain PyTorch on
    one thread."""
    import torch
    import gpipe
    sys.path.insert(0, os.path.join(HERE, "..", "examples", "python"))
    from fashion_mnist import FashionMNIST, cnn as make_cnn
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(FashionMNIST(args.data_dir, train=True, limit=args.samples), batch_size=128,
                                         shuffle=True)
    model = make_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if args.epoch == "pytorch":
        set_threads(1)
        seconds = 0.0
        for x, y in loader:
            begin = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            seconds += time.perf_counter() - begin
        print(json.dumps({"samples_per_s": len(loader.dataset) / seconds}))
        return
    pipe = gpipe.GPipe(model, devices=2)
    summary = gpipe.Summary(pipe)
    with pipe.update_on_devices(opt):  # as `gpipe train` updates by default
        for x, y in loader:
            with summary.step(len(x)):
                pipe.train_step(x, y)
    print(json.dumps({"samples_per_s": summary.samples_per_s, "schedule": pipe.schedule, "chunks": pipe.chunks,
                      "balance": pipe.balance}))


def traced(args):
    rows = []
    for model, samples in (("resnet18", 64), ("gpt2", 32)):
        names = [f"{model} gpipe", f"{model} pytorch 2", f"{model} pytorch 1"]
        results = alternate(names, args.traced_steps, args.warmup, args)
        seconds = {n: [r["seconds"] for r in results[n]] for n in names}
        info = results[names[0]][-1]["gil_share"]  # gpipe's: its choice and the trace's and split's seconds
        for name in names:
            row = {"comparison": "traced", "model": model, "contender": name,
                   "samples_per_s": samples / statistics.median(seconds[name]), "steps": len(seconds[name]),
                   "gpipe_speedup_per_step": ratios(seconds[name], seconds[names[0]])}
            rows.append(row)
            print(f"traced  {name:20s} {row['samples_per_s']:7.1f} samples/s   gpipe.GPipe K=2 "
                  f"{span(row['gpipe_speedup_per_step'])} per step", flush=True)
        limit = {k: v / 2 for k, v in rows[-1]["gpipe_speedup_per_step"].items()}
        rows[-3].update(of_2_core_limit=limit, **{k: v for k, v in info.items() if k != "gil_share"})
        print(f"traced  {model}: gpipe.GPipe {span(limit)} of the 2-core limit per step; traced in "
              f"{info['trace_s']:.3f} s, cut into {info['pieces']} pieces (compiled) in {info['split_s']:.2f} s; "
              f"ran {info['schedule']} M={info['chunks']} cut {info['balance']}", flush=True)
    return rows


def transformer(args):
    names = ["transformer gpipe", "transformer Pipe"]
    medians, answers = rounds(names, args.transformer_steps, args.warmup, args.rounds, args)
    row = {"comparison": "transformer", "stages": 2, "micro_batches": 8, "checkpoint": "except_last",
           "gpipe_samples_per_s": 32 / statistics.median(medians[names[0]]),
           "pipe_samples_per_s": 32 / statistics.median(medians[names[1]]),
           "gpipe_over_pipe_per_round": ratios(medians[names[1]], medians[names[0]]),
           "rounds": args.rounds, "steps_per_round": args.transformer_steps,
           "gil_share_of_step": statistics.median(r["gil_share"] for r in answers[names[0]])}
    print(f"transformer K=2 M=8: gpipe.GPipe {row['gpipe_samples_per_s']:.2f}, Pipe {row['pipe_samples_per_s']:.2f} "
          f"samples/s: {span(row['gpipe_over_pipe_per_round'])} per round; gpipe held the GIL "
          f"{100 * row['gil_share_of_step']:.3f}% of a step")
    return [row]


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def blas_kernel():
    """OpenBLAS's kernel, as gpipe reads it (the same library torch loaded)."""
    import gpipe
    kernel = gpipe.blas_kernel()
    return {"running": kernel.running, "best": kernel.best, "chosen_by": kernel.chosen_by}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--samples", type=int, default=12800, help="training samples (cnn, cli)")
    parser.add_argument("--steps", type=int, default=100, help="cnn: timed steps of each contender")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5, help="cli and transformer: rounds")
    parser.add_argument("--transformer-steps", type=int, default=6, help="transformer: timed steps per round")
    parser.add_argument("--traced-steps", type=int, default=20, help="traced: timed steps of each contender")
    parser.add_argument("--gpipe", default=os.path.join(HERE, "..", "build", "apps", "gpipe"))
    parser.add_argument("--only", choices=["cnn", "cli", "traced", "transformer"], action="append")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--epoch", choices=["gpipe", "pytorch"], help=argparse.SUPPRESS)
    parser.add_argument("--results", default=os.path.join(HERE, "results", "python-compare.json"))
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args)
    if args.epoch:
        return epoch(args)
    rows = []
    for part, run in (("cnn", cnn), ("cli", cli), ("traced", traced), ("transformer", transformer)):
        if part in (args.only or ["cnn", "cli", "traced", "transformer"]):
            rows += run(args)
    import torch
    doc = {"command": " ".join(["bench/python_compare.py"] + sys.argv[1:]),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "machine": {"cores": os.cpu_count(), "cpu": cpu_model(), "blas_kernel": blas_kernel(),
                       "torch": torch.__version__},
           "results": []}
    # Each row names its machine: the rows not run this time keep theirs.
    doc["results"] = [dict(r, date=doc["date"], machine=doc["machine"]) for r in rows]
    try:  # the comparisons not run this time stay as they were
        with open(args.results) as f:
            doc["results"] = [r for r in json.load(f)["results"]
                              if r["comparison"] not in {x["comparison"] for x in rows}] + doc["results"]
    except (OSError, ValueError, KeyError):
        pass
    os.makedirs(os.path.dirname(args.results), exist_ok=True)
    with open(args.results + ".tmp", "w") as out:
        json.dump(doc, out, indent=2)
    os.replace(args.results + ".tmp", args.results)  # whole or not at all
    print(f"results written to {args.results}", file=sys.stderr)


if __name__ == "__main__":
    main()
