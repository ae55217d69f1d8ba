"""The planner, the per-layer profile and the predicted step, before anything runs.

    import torch, gpipe
    model = torch.nn.Sequential(...)
    sample = torch.randn(8, 784)                     # one micro-batch
    for c in gpipe.plan(model, sample, devices=8, memory_per_device="16GiB", batch=256)[:3]:
        print(c.devices, c.replicas, c.micro_batches, c.schedule, c.checkpoint, c.samples_per_s)
    layers = gpipe.profile(model, sample)            # one LayerProfile per layer, per sample
    step = gpipe.predict(model, sample, chunks=4, devices=2, schedule="1f1b")
    print(step.step_s, step.bubble, step.peak_bytes)

The same library calls as `gpipe plan` (include/gpipe/planner.h, include/gpipe/cost_model.h).
Profiling runs the model here, in training mode, and leaves it as it was: its parameters and their
gradients, its buffers (BatchNorm's running statistics, num_batches_tracked), its modes and torch's
random numbers. Errors are ValueErrors that name the argument.
"""
import dataclasses
import numbers
import re
from typing import List, Optional, Tuple

import torch

from . import _gpipe
from .pipe import _in_python_words, _one_of, _script, _whole

_OPTIMIZERS = tuple(_gpipe.plan_optimizer_names())
_LOSSES = (None, "cross_entropy", "mse")


@dataclasses.dataclass(frozen=True)
class Configuration:
    """One configuration of the cluster and what the cost model predicts of it (a row of `gpipe plan`).

    devices K (devices per pipeline), replicas D, micro_batches M, schedule, virtual_stages V,
    checkpoint (re-materialization), balance (layers per stage, K·V entries); samples_per_s and
    step_s (one step of the global batch, the replicas' gradient all-reduce included), bubble (the
    idle share), and per device of a pipeline: peak_bytes (activations and what the step holds),
    static_bytes (parameters, gradients, optimizer state), total_bytes (their sum);
    largest_total_bytes, and fits (largest_total_bytes within memory_per_device)."""
    devices: int
    replicas: int
    micro_batches: int
    schedule: str
    virtual_stages: int
    checkpoint: str
    balance: List[int]
    samples_per_s: float
    step_s: float
    bubble: float
    peak_bytes: List[int]
    static_bytes: List[int]
    total_bytes: List[int]
    largest_total_bytes: int
    fits: bool


class Plans(list):
    """gpipe.plan's answer: the configurations, fastest first, with what was planned:
    description (the model, as `gpipe plan` prints it), parameters, least_micro_batch_rows (2 for a
    model whose BatchNorm cannot train on one row) and considered (configurations predicted)."""

    def __init__(self, rows, description, parameters, least_micro_batch_rows, considered):
        super().__init__(rows)
        self.description = description
        self.parameters = parameters
        self.least_micro_batch_rows = least_micro_batch_rows
        self.considered = considered


@dataclasses.dataclass(frozen=True)
class LayerProfile:
    """One layer's costs, per sample (a row of the sample) except parameter_bytes: forward_s,
    backward_s (input and weight gradients), input_grad_s (I) and weight_grad_s (W) seconds;
    parameter_bytes (the whole layer's), kept_bytes (what its forward keeps for backward, its output
    included), chain_kept_bytes (the same when the next layer of its stage runs on its output),
    output_bytes (what crosses a stage boundary after it), forward_peak_bytes, backward_peak_bytes,
    weight_kept_bytes (kept from its I until its W)."""
    forward_s: float
    backward_s: float
    input_grad_s: float
    weight_grad_s: float
    parameter_bytes: int
    kept_bytes: float
    chain_kept_bytes: float
    output_bytes: float
    forward_peak_bytes: float
    backward_peak_bytes: float
    weight_kept_bytes: float


class Profile(list):
    """gpipe.profile's answer: one LayerProfile per layer of the model, in order, and rows (the
    sample's rows it was timed on), least_micro_batch_rows, skips ((name, bytes per sample) of each
    Stash/Pop connection), tied ((bytes, [layers]) of each parameter tensor several layers use: a
    tied weight, held once per device), loss_kept_bytes and loss_backward_peak_bytes (per sample;
    with a loss), state_per_parameter_byte (of the optimizer), action_overhead_s and step_overhead_s
    (what gpipe's pipeline adds on this machine to each forward or backward and to each step)."""

    def __init__(self, layers, rows, info):
        super().__init__(layers)
        self.rows = rows
        self.least_micro_batch_rows = info["least_micro_batch_rows"]
        self.skips = [tuple(s) for s in info["skips"]]
        self.tied = [(bytes_, list(users)) for bytes_, users in info["tied"]]
        self.loss_kept_bytes = info["loss_kept_bytes"]
        self.loss_backward_peak_bytes = info["loss_backward_peak_bytes"]
        self.state_per_parameter_byte = info["state_per_parameter_byte"]
        self.action_overhead_s = info["action_overhead_s"]
        self.step_overhead_s = info["step_overhead_s"]


@dataclasses.dataclass(frozen=True)
class Prediction:
    """gpipe.predict's answer for one step of `micro_batch_rows` (one entry per micro-batch):
    step_s (the simulated step plus one optimizer update of every parameter on one thread), bubble
    (the simulated idle share), and per device: peak_bytes (above what it held before the step, as
    the pipeline's measured peak), static_bytes (parameters, gradients, optimizer state),
    total_bytes; largest_device; the plan predicted: devices K, virtual_stages V, balance, placement
    (the device of each stage)."""
    step_s: float
    bubble: float
    peak_bytes: List[int]
    static_bytes: List[int]
    total_bytes: List[int]
    largest_device: int
    devices: int
    virtual_stages: int
    balance: List[int]
    placement: List[int]
    micro_batch_rows: List[int]


# The planner's option names in its errors, as gpipe.plan's arguments.
_NAMES = {"devices": "stages", "micro_batches": "micro_batches", "schedule": "schedules", "checkpoint": "checkpoints"}


def _call(function, *args, names=None):
    try:
        return function(*args)
    except ValueError as e:
        message = _in_python_words(e, names)
        raise ValueError(message if message.startswith("gpipe:") else "gpipe: " + message) from None


def _number(value, name, positive=True):
    """A finite number above 0 (or, not `positive`, at least 0)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not abs(value) < float("inf") \
            or not (value > 0 if positive else value >= 0):
        raise ValueError(f"gpipe: {name} must be a finite number {'above' if positive else 'of at least'} 0 "
                         f"(got {value!r})")
    return float(value)


def _positive(value, name):
    value = _whole(value, name)
    if value < 1:
        raise ValueError(f"gpipe: {name} must be at least 1 (got {value})")
    return value


def _sequential(model):
    if not isinstance(model, torch.nn.Sequential) or type(model).forward is not torch.nn.Sequential.forward:
        raise ValueError(f"gpipe: model must be a torch.nn.Sequential, whose forward is the chain of its children "
                         f"(got {type(model).__name__}); wrap the layers in torch.nn.Sequential(...)")
    if len(model) == 0:
        raise ValueError("gpipe: model has no layers")
    return _script(model)


def _sample(sample):
    """(tensors, is_tuple): a tensor, or a tuple of tensors for a model whose input is one."""
    if isinstance(sample, torch.Tensor):
        items, is_tuple = [sample], False
    elif isinstance(sample, (tuple, list)) and sample and all(isinstance(t, torch.Tensor) for t in sample):
        items, is_tuple = list(sample), True
    else:
        raise ValueError(f"gpipe: sample must be a torch.Tensor (one micro-batch) or a tuple of them "
                         f"(got {type(sample).__name__})")
    if items[0].dim() == 0 or items[0].size(0) == 0:
        raise ValueError(f"gpipe: sample has no rows (shape {list(items[0].shape)}); give one micro-batch of at "
                         f"least one row")
    return [t.detach() for t in items], is_tuple


def _loss(loss, target, rows):
    _one_of(loss, "loss", _LOSSES)
    if loss is None:
        if target is not None:
            raise ValueError("gpipe: target is profiled with a loss; give loss=\"cross_entropy\" or \"mse\" too")
        return "", None
    if not isinstance(target, torch.Tensor):
        raise ValueError(f"gpipe: loss={loss!r} needs the sample's target, a torch.Tensor of {rows} rows")
    if target.dim() == 0 or target.size(0) != rows:
        raise ValueError(f"gpipe: target has {target.size(0) if target.dim() else 0} rows; the sample has {rows}")
    return loss, target.detach()


def _list(values, name, check):
    if values is None:
        return []
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ValueError(f"gpipe: {name} must be a list (got {values!r})")
    out = [check(v) for v in values]
    if not out:
        raise ValueError(f"gpipe: {name} is empty; give at least one, or None for all")
    return out


def _bytes(value, name):
    if isinstance(value, str):
        try:
            value = _gpipe.parse_bytes(value)
        except ValueError as e:
            raise ValueError(f"gpipe: {name}: {str(e).removeprefix('gpipe: ')}") from None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= value < 2**63:
        raise ValueError(f"gpipe: {name} must be a whole number of bytes, at least 1, or text such as \"16GiB\" "
                         f"(got {value!r})")
    return int(value)


_TRANSFORMER = ("layers", "width", "heads", "ffn", "vocab", "sequence")


def plan(model=None, sample=None, *, devices, batch, memory_per_device="16GiB", optimizer="adam", schedules=None,
         checkpoints=None, stages=None, micro_batches=None, top=10, fitting_only=True, speed=1.0, latency_us=5.0,
         bandwidth_gb_s=25.0, loss=None, target=None, threads=1, task=None, seed=0, transformer=None,
         flops=100e12):
    """The configurations that fit a model on a cluster of `devices` devices of `memory_per_device`
    each (bytes, or text: "16GiB"), for a global batch of `batch` rows, fastest first, predicted by
    the cost model and the schedule simulator before anything runs, as `gpipe plan` answers: a
    Plans list of Configuration.

    The model, one of:
      model, sample   a torch.nn.Sequential (TorchScript-able, as GPipe takes it) and one
                      micro-batch (a tensor, or a tuple of tensors), profiled here (gpipe.profile) on
                      a device `speed` times this machine's core, with `threads` intra-op threads;
                      with loss ("cross_entropy", "mse") and the sample's target the loss's bytes too
      task            a built-in task or benchmark workload by name (gpipe.tasks.names(workloads=True)),
                      profiled on its own batch, its model's weights drawn from `seed`
      transformer     a Transformer by shape: a dict of layers, width, heads, ffn, vocab, sequence
                      (and bytes_per_value 4 or 2), on devices of `flops` FLOP/s
    The search: optimizer ("sgd", "momentum", "adam" or "adamw": the state kept per parameter), schedules
    and checkpoints to consider (None: all; "auto" among the schedules: all), stages (K to consider; None: every divisor of
    devices), micro_batches (M to consider; None: 1, 2, 4, ... up to max(8, 4K) and the rows per
    replica), links of latency_us microseconds and bandwidth_gb_s GB/s. The answer holds the `top`
    fastest that fit (top=None: all of them); with fitting_only=False, every configuration, those
    that do not fit after, least memory first. ValueError when none fits, naming the least need and
    what to try."""
    sources = (model is not None) + (task is not None) + (transformer is not None)
    if sources != 1:
        raise ValueError(f"gpipe: {'no model given' if sources == 0 else 'more than one model given'}: give one of "
                         f"model and sample, task=NAME, or transformer=dict(layers=..., width=..., heads=..., ffn=..., "
                         f"vocab=..., sequence=...)")
    settings = _gpipe.SearchSettings()
    settings.devices = _positive(devices, "devices")
    settings.memory_per_device = _bytes(memory_per_device, "memory_per_device")
    if isinstance(batch, bool) or not isinstance(batch, numbers.Integral) or batch < 1:
        raise ValueError(f"gpipe: batch must be a whole number of rows, at least 1 (got {batch!r})")
    if batch >= 2**63:
        raise ValueError(f"gpipe: batch is out of range (got {batch}); give a whole number of rows below 2^63")
    settings.batch = int(batch)
    _one_of(optimizer, "optimizer", _OPTIMIZERS)
    settings.schedules = _list(schedules, "schedules", lambda s: _one_of(s, "every entry of schedules",
                                                                        tuple(_gpipe.schedule_names()) + ("auto",)))
    if not settings.schedules:
        settings.schedules = list(_gpipe.schedule_names())
    settings.checkpoints = _list(checkpoints, "checkpoints",
                                 lambda c: _one_of(c, "every entry of checkpoints", tuple(_gpipe.checkpoint_names())))
    if not settings.checkpoints:
        settings.checkpoints = ["never", "except_last", "always"]
    settings.stages = _list(stages, "stages", lambda k: _positive(k, "every entry of stages"))
    settings.micro_batches = _list(micro_batches, "micro_batches", lambda m: _positive(m, "every entry of micro_batches"))
    top = None if top is None else _positive(top, "top")
    settings.latency_s = _number(latency_us, "latency_us", positive=False) * 1e-6
    settings.bytes_per_s = _number(bandwidth_gb_s, "bandwidth_gb_s") * 1e9
    if model is not None or task is not None:
        speed = _number(speed, "speed")
        threads = _positive(threads, "threads")
        if transformer is None and flops != 100e12:
            raise ValueError("gpipe: flops applies to a Transformer given by shape (transformer=...); leave it out")
    if model is not None:
        if sample is None:
            raise ValueError("gpipe: a model needs a sample, one micro-batch of its input, to be profiled on")
        scripted = _sequential(model)
        items, is_tuple = _sample(sample)
        loss_name, target = _loss(loss, target, items[0].size(0))
        answer = _call(_gpipe.plan_model, scripted, items, is_tuple, optimizer, speed, threads, loss_name, target,
                       settings, names=_NAMES)
    elif task is not None:
        if sample is not None or loss is not None or target is not None:
            raise ValueError("gpipe: a task has its own sample and loss; leave sample, loss and target out")
        _one_of(task, "task", tuple(_gpipe.task_names(True)))
        answer = _call(_gpipe.plan_task, task, _seed(seed), optimizer, speed, threads, settings, names=_NAMES)
    else:
        if sample is not None or loss is not None or target is not None or speed != 1.0:
            raise ValueError("gpipe: a Transformer by shape takes no sample, loss, target or speed (its device's "
                             "speed is flops)")
        if not isinstance(transformer, dict) or set(transformer) - set(_TRANSFORMER) - {"bytes_per_value"} \
                or not set(_TRANSFORMER) <= set(transformer):
            raise ValueError(f"gpipe: transformer must be a dict of {', '.join(_TRANSFORMER)} (and bytes_per_value) "
                             f"(got {transformer!r})")
        shape = [_positive(transformer[k], f"transformer[{k!r}]") for k in _TRANSFORMER]
        shape.append(_one_of(transformer.get("bytes_per_value", 4), "transformer['bytes_per_value']", (4, 2)))
        answer = _call(_gpipe.plan_transformer, shape, _number(flops, "flops"), optimizer, settings,
                       names={**_NAMES, "layers": "transformer['layers']"})
    rows = [Configuration(**{f.name: c[f.name] for f in dataclasses.fields(Configuration)})
            for c in answer["configurations"]]
    fitting = [c for c in rows if c.fits]
    if not fitting:
        raise ValueError("gpipe: " + answer["no_fit"])
    shown = fitting if fitting_only else rows
    return Plans(shown if top is None else shown[:top], answer["description"], answer["parameters"],
                 answer["least_micro_batch_rows"], len(rows))


def _seed(seed):
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**64:
        raise ValueError(f"gpipe: seed must be a whole number from 0 to 2^64-1 (got {seed!r})")
    return int(seed)


def profile(model, sample, *, optimizer="sgd", speed=1.0, threads=1, warmup=1, repetitions=3, loss=None,
            target=None):
    """The per-layer profile of `model` (a torch.nn.Sequential, TorchScript-able) on `sample` (one
    micro-batch: a tensor, or a tuple of tensors), run here in training mode on the calling thread
    with `threads` intra-op threads, `warmup` untimed and `repetitions` timed passes (each figure
    the median): a Profile list of one LayerProfile per layer, every figure per sample (row), its
    times divided by `speed`. With loss ("cross_entropy", "mse") and the sample's target the loss's
    bytes too. `optimizer` ("sgd", "momentum", "adam", "adamw") sets state_per_parameter_byte. The model is
    left as it was (parameters, gradients, buffers, modes, random numbers)."""
    scripted = _sequential(model)
    items, is_tuple = _sample(sample)
    _one_of(optimizer, "optimizer", _OPTIMIZERS)
    loss_name, target = _loss(loss, target, items[0].size(0))
    info = _call(_gpipe.profile, scripted, items, is_tuple, optimizer, _number(speed, "speed"),
                 _positive(threads, "threads"), _whole(warmup, "warmup"), _positive(repetitions, "repetitions"),
                 loss_name, target)
    layers = [LayerProfile(**layer) for layer in info["layers"]]
    return Profile(layers, items[0].size(0), info)


def predict(model, sample, *, chunks=1, devices=None, schedule="gpipe", checkpoint="except_last", balance=None,
            virtual_stages=None, batch=None, optimizer="sgd", speed=1.0, threads=1, loss=None, target=None):
    """What one training step of GPipe(model, balance, chunks, checkpoint, schedule, devices,
    virtual_stages) costs with these (named schedule) arguments, whose defaults here are chunks=1,
    fill-drain and except_last, not GPipe's (devices: K, by default len(balance) / V, or 2 without a
    balance), predicted before it runs (cost_model.h's predict over the plan): the
    model profiled here on `sample` (one micro-batch, as gpipe.profile), then a step of `batch`
    rows (default: the sample's rows times chunks) in `chunks` micro-batches simulated. Without a
    balance the layers are cut by their profiled time, as GPipe(balance=None) with a named schedule
    cuts them. Returns
    a Prediction: step_s, bubble, and peak, static and total bytes per device. `optimizer` sets
    the optimizer state counted per parameter. The model is left as it was."""
    scripted = _sequential(model)
    items, is_tuple = _sample(sample)
    rows = items[0].size(0)
    if balance is not None and (isinstance(balance, (str, bytes)) or not hasattr(balance, "__iter__")):
        raise ValueError(f"gpipe: balance must be a list of layers per stage, e.g. [3, 8] (got {balance!r})")
    balance = [] if balance is None else [_whole(b, "every entry of balance") for b in balance]
    chunks = _positive(chunks, "chunks")
    devices = (0 if balance else 2) if devices is None else _whole(devices, "devices")
    batch = rows * max(chunks, 1) if batch is None else _positive(batch, "batch")
    _one_of(schedule, "schedule", tuple(_gpipe.schedule_names()))
    _one_of(checkpoint, "checkpoint", tuple(_gpipe.checkpoint_names()))
    _one_of(optimizer, "optimizer", _OPTIMIZERS)
    loss_name, target = _loss(loss, target, rows)
    answer = _call(_gpipe.predict, scripted, items, is_tuple, devices, balance, chunks, schedule, checkpoint,
                   0 if virtual_stages is None else _whole(virtual_stages, "virtual_stages"), batch, optimizer,
                   _number(speed, "speed"), _positive(threads, "threads"), loss_name, target,
                   names={"micro_batches": "chunks"})
    return Prediction(**answer)


__all__ = ["Configuration", "LayerProfile", "Plans", "Prediction", "Profile", "plan", "predict", "profile"]
