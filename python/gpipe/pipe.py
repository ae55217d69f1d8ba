"""GPipe: a torch.nn.Sequential trained through gpipe's C++ pipeline."""
import numbers
import time
import warnings

import torch

from . import _gpipe

_CHECKPOINTS = ("always", "except_last", "never")
_BATCH_NORM = ("deferred", "per-micro-batch")
_RUNTIMES = ("auto", "threads", "mpi")


def schedule_names():
    """The schedules gpipe runs: gpipe (fill-drain), 1f1b, interleaved, zb1p."""
    return list(_gpipe.schedule_names())


def _whole(value, name, least=1):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(f"gpipe: {name} must be a whole number of at least {least} (got {value!r})")
    return int(value)


def _one_of(value, name, choices):
    if value not in choices:
        raise ValueError(f"gpipe: {name} must be one of {', '.join(map(repr, choices))} (got {value!r})")
    return value


def _script(model):
    try:
        with warnings.catch_warnings():  # torch.nn's own layers (TransformerEncoderLayer) warn of constants
            warnings.filterwarnings("ignore", message=".*was found in ScriptModule constants")
            return torch.jit.script(model)
    except Exception as e:  # TorchScript's own error says what it cannot compile, and where
        reason = str(e).strip()
        raise ValueError(
            "gpipe: the model cannot be compiled by TorchScript, which gpipe needs to run its layers in C++ "
            "threads without the GIL. TorchScript says:\n" + reason + "\nMake each layer scriptable "
            "(type-annotate its forward, avoid Python-only constructs; see "
            "https://pytorch.org/docs/stable/jit_language_reference.html), or replace the layer it names.") from None


def _tensor(value, name):
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"gpipe: {name} must be a torch.Tensor (got {type(value).__name__})")
    return value


class GPipe:
    """A torch.nn.Sequential cut into consecutive stages over `devices` devices, trained with GPipe:
    each mini-batch split into `chunks` micro-batches that flow through the stages, the devices C++
    threads that run at the same time and never hold the GIL (or, under mpirun, one rank each).

    The model's own parameters are trained in place: train_step adds to each parameter's .grad
    exactly what loss.backward() on one device would, so any torch.optim optimizer, LR scheduler,
    torch.nn.utils.clip_grad_norm_ and model.state_dict() work unchanged.

    model          a torch.nn.Sequential that torch.jit.script accepts; its children are the layers
    balance        layers per stage (K·V entries), or None: cut by the layers' measured time on the
                   first batch's first micro-batch (until then `balance` is None)
    chunks         M, micro-batches per mini-batch
    checkpoint     re-materialization: "always", "except_last" or "never"
    schedule       "gpipe" (fill-drain), "1f1b", "interleaved" or "zb1p" (schedule_names())
    devices        K; by default len(balance) / V, or 2 without a balance
    virtual_stages V, stages per device (interleaved: 2 by default)
    batch_norm     "deferred": BatchNorm's running statistics once per mini-batch from all its rows
                   (the paper's rule); "per-micro-batch": as M small batches would
    threads        intra-op threads of each device
    runtime        "threads" (this process), "mpi" (one rank per device; mpirun -np K·D), or
                   "auto": MPI when started by mpirun with more than one rank
    """

    def __init__(self, model, balance=None, chunks=1, checkpoint="except_last", schedule="gpipe", devices=None,
                 virtual_stages=None, batch_norm="deferred", threads=1, runtime="auto"):
        if not isinstance(model, torch.nn.Sequential):
            raise ValueError(f"gpipe: the model must be a torch.nn.Sequential, whose forward is the chain of its "
                             f"children that gpipe cuts into stages (got {type(model).__name__}); wrap the layers in "
                             f"torch.nn.Sequential(...)")
        if len(model) == 0:
            raise ValueError("gpipe: the model is an empty torch.nn.Sequential; give it at least one layer")
        self.chunks = _whole(chunks, "chunks")
        self.checkpoint = _one_of(checkpoint, "checkpoint", _CHECKPOINTS)
        self.schedule = _one_of(schedule, "schedule", tuple(schedule_names()))
        self.batch_norm = _one_of(batch_norm, "batch_norm", _BATCH_NORM)
        self.threads = _whole(threads, "threads")
        self.runtime = _one_of(runtime, "runtime", _RUNTIMES)
        self.virtual_stages = 0 if virtual_stages is None else _whole(virtual_stages, "virtual_stages")
        if balance is not None:
            if isinstance(balance, (str, bytes)) or not hasattr(balance, "__iter__"):
                raise ValueError(f"gpipe: balance must be a list of layers per stage, e.g. [3, 8] (got {balance!r})")
            balance = [_whole(b, "every entry of balance") for b in balance]
        V = self.virtual_stages or _gpipe.default_virtual_stages(self.schedule)
        if devices is None:
            devices = len(balance) // V if balance else 2
        self.devices = _whole(devices, "devices")
        # The plan (K, V, M, the cut, the schedule) checked now, before any work, whatever the balance.
        _gpipe.check_plan(len(model), self._settings(balance or []))
        self.model = model
        self._scripted = _script(model)
        self._pipe = None
        self._step_seconds = 0.0
        if balance is not None:
            self._build(balance)

    def _settings(self, balance):
        s = _gpipe.Settings()
        s.balance = list(balance)
        s.micro_batches = self.chunks
        s.checkpoint = self.checkpoint
        s.schedule = self.schedule
        s.devices = self.devices
        s.virtual_stages = self.virtual_stages
        s.deferred_batch_norm = self.batch_norm == "deferred"
        s.threads = self.threads
        s.runtime = self.runtime
        return s

    def _build(self, balance):
        self._pipe = _gpipe.Pipeline(self._scripted, self._settings(balance))

    def _ready(self, sample):
        """The pipeline, cut by measured time on `sample`'s first micro-batch if no balance was given."""
        if self._pipe is None:
            rows = -(-sample.size(0) // self.chunks) if sample.dim() > 0 else 1
            balance = _gpipe.balance_by_time(self._scripted, sample[:rows], self.devices, self.threads)
            self._build(_gpipe.first_rank_list(balance))  # under MPI every rank takes rank 0's cut
        return self._pipe

    def train_step(self, input, target, loss="cross_entropy"):
        """Forward and backward of the mini-batch (input, target) through the pipeline: adds the
        gradient of the mini-batch's mean loss to every parameter's .grad and returns that loss as
        a float. `loss`: "cross_entropy" (integer class targets), "mse", or a torch.jit.script-ed
        function (output, target) -> the mean over the batch. The GIL is released for the whole
        step; Ctrl-C raises KeyboardInterrupt with parameters and gradients as they were."""
        _tensor(input, "input")
        _tensor(target, "target")
        if not isinstance(loss, (str, torch.jit.ScriptFunction)):
            raise ValueError("gpipe: loss must be \"cross_entropy\", \"mse\" or a torch.jit.script-ed function "
                             "(output, target) -> scalar; decorate yours with @torch.jit.script")
        if isinstance(loss, str):
            _one_of(loss, "loss", ("cross_entropy", "mse"))
        if input.dim() == 0:
            raise ValueError("gpipe: the input has no batch dimension; gpipe splits dim 0 into micro-batches")
        begin = time.perf_counter()
        value = self._ready(input).train_step(input, target, loss)
        self._step_seconds = time.perf_counter() - begin
        return value

    @property
    def gil_share(self):
        """The share of the last train_step's wall time in which gpipe held the GIL (the rest, the
        devices' work, other Python threads could run)."""
        if self._pipe is None or not self._step_seconds:
            return 0.0
        return max(0.0, 1.0 - self._pipe.gil_free_seconds / self._step_seconds)

    def __call__(self, input):
        """Pipelined inference with the model's current train/eval mode, keeping no autograd graph:
        the output (under MPI: on the rank of each replica's last stage, its replica's rows; None on
        the other ranks)."""
        _tensor(input, "input")
        if input.dim() == 0:
            raise ValueError("gpipe: the input has no batch dimension; gpipe splits dim 0 into micro-batches")
        return self._ready(input).forward(input)

    forward = __call__

    @property
    def balance(self):
        """Layers per stage; None until the first batch when the pipeline balances by time."""
        return None if self._pipe is None else list(self._pipe.balance)

    @property
    def bubble(self):
        """The last step's measured bubble: the share of device time spent idle (collective under MPI)."""
        return 0.0 if self._pipe is None else self._pipe.bubble()

    def trace(self, path):
        """Writes the last step's timeline: an SVG chart if `path` ends in .svg, else Chrome-trace JSON
        (open it in Perfetto). Under MPI every rank calls it; rank 0 writes."""
        if self._pipe is None:
            raise ValueError("gpipe: no step has run yet, so there is no timeline to write")
        self._pipe.write_trace(str(path))

    def schedule_text(self):
        """The schedule as a grid: one row per device, one column per time slot."""
        if self._pipe is None:
            raise ValueError("gpipe: the schedule is decided with the cut, on the first batch (balance=None)")
        return self._pipe.schedule_text()

    def save(self, path):
        """Writes the whole model to one file, gathered from every rank under MPI (every rank calls
        it; rank 0 writes, and its model then holds every rank's values): TorchScript, which
        torch.jit.load reads (model.load_state_dict(torch.jit.load(path).state_dict()) takes it
        back), written whole or not at all. Optimizer state is not in it: torch.save(opt.state_dict())."""
        if self._pipe is None:
            raise ValueError("gpipe: the pipeline is built on the first batch (balance=None); train a step first")
        self._pipe.save(str(path))

    def parameters(self):
        """The parameters this process trains (all of them in one process; under MPI this rank's
        stages'): the model's own Parameter objects."""
        return [] if self._pipe is None else list(self._pipe.parameters())

    def describe(self):
        """Where the devices run: "one process, 2 device threads" or "MPI: 4 ranks = 2 devices x 2 replicas"."""
        return "not built yet" if self._pipe is None else self._pipe.describe()

    def sum(self, value):
        """`value` summed over every rank of an MPI job (collective; `value` itself in one process):
        e.g. the correct predictions that each rank holding outputs counted."""
        return value if self._pipe is None else self._pipe.sum(float(value))

    @property
    def rank(self):
        """This process's MPI rank (0 in one process): rank 0 prints."""
        return 0 if self._pipe is None else self._pipe.rank
