"""GPipe: a torch.nn.Module (a Sequential as it is, any other traced and cut) trained through gpipe's C++
pipeline."""
import atexit
import collections
import contextlib
import functools
import inspect
import io
import numbers
import os
import re
import sys
import threading
import time
import warnings

import torch

from . import _gpipe
from . import norm as _norm
from . import trace as _trace


def schedule_names():
    """The names of the schedules gpipe runs, in the order of its registry (schedule.h's schedule_table)."""
    return list(_gpipe.schedule_names())


def _whole(value, name):
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point() \
            and not value.is_complex() and value.dtype != torch.bool:
        value = int(value.item())  # an entry of balance=torch.tensor([3, 4])
    elif hasattr(value, "dtype") and hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        value = value.item()  # a NumPy whole number
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"gpipe: {name} must be a whole number (got {value!r})")
    if not -2**31 <= value < 2**31:
        raise ValueError(f"gpipe: {name} is out of range (got {value}); give a whole number below 2^31")
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


def _check_layer_types(scripted):
    """Every layer takes and returns a tensor or a flat tuple of tensors, which is what gpipe passes
    from layer to layer: refused here, before any work, rather than inside a stage."""
    for index, (name, layer) in enumerate(scripted.named_children()):
        try:
            returns = layer.forward.schema.returns
        except (AttributeError, RuntimeError):
            continue
        kinds = [str(r.type) for r in returns]
        flat = all(k == "Tensor" for k in kinds) or (
            len(kinds) == 1 and kinds[0].startswith("Tuple[") and
            all(part.strip() == "Tensor" for part in kinds[0][len("Tuple["):-1].split(",")))
        if not flat:
            raise ValueError(f"gpipe: layer {index} ({name!r}, {type(layer).__name__}) returns {', '.join(kinds)}; "
                             f"gpipe passes a tensor or a flat tuple of tensors (Tuple[Tensor, ...]) from layer to "
                             f"layer: return one of those (flatten a nested tuple)")


def _fingerprint(model):
    """What GPipe compiled of `model`: its children, its parameters' and buffers' tensors (by identity)
    and the plain settings of its modules (Dropout's p, BatchNorm's momentum...). Cheap to take at
    each call; a change means the model is no longer the one the pipeline runs."""
    layers = tuple((name, id(child), type(child)) for name, child in model.named_children())
    tensors, settings = [], []
    for prefix, module in model.named_modules():
        for name, t in list(module._parameters.items()) + list(module._buffers.items()):
            tensors.append((f"{prefix}.{name}" if prefix else name, id(t)))
        for key, value in vars(module).items():
            if key.startswith("_") or key == "training":
                continue
            if isinstance(value, (bool, int, float, str, type(None))) or (
                    isinstance(value, tuple) and all(isinstance(v, (bool, int, float, str)) for v in value)):
                settings.append((prefix, key, value))
    return layers, tuple(tensors), tuple(settings)


def _what_changed(before, after):
    layers0, tensors0, settings0 = before
    layers1, tensors1, settings1 = after
    if len(layers0) != len(layers1):
        return f"it had {len(layers0)} layers and has {len(layers1)} now"
    for n, (a, b) in enumerate(zip(layers0, layers1)):
        if a != b:
            return f"layer {n} ({b[0]!r}) was replaced by another module ({b[2].__name__})"
    for (name0, id0), (name1, id1) in zip(tensors0, tensors1):
        if (name0, id0) != (name1, id1):
            return f"the parameter or buffer {name1!r} is another tensor now (assigned after GPipe was built)"
    if len(tensors0) != len(tensors1):
        return "a parameter or buffer was added or removed"
    for a, b in zip(settings0, settings1):
        if a != b:
            where = f"layer {a[0]!r}" if a[0] else "the model"
            return f"{where}'s {a[1]} changed from {a[2]!r} to {b[2]!r}"
    return "its settings changed"


def _path(value, name):
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"gpipe: {name} must be a file path, a str or os.PathLike (got {type(value).__name__})")
    path = os.fspath(value)
    if not path:
        raise ValueError(f"gpipe: {name} is empty; give a file path")
    return path


def _chain_of(model):
    """A torch.nn.Sequential's layers as a plain Sequential (a subclass that keeps Sequential's forward:
    the same modules, so the same parameters), with the model's mode; None for a model gpipe traces."""
    if not isinstance(model, torch.nn.Sequential) or type(model).forward is not torch.nn.Sequential.forward:
        return None
    layers = model if type(model) is torch.nn.Sequential else torch.nn.Sequential(model._modules)
    layers.training = model.training  # the container's flag only: children keep their own modes
    return layers


def _compile(layers, deferred):
    """The Sequential `layers` compiled (BatchNorms inside them deferred where `deferred`), each
    layer's return type checked."""
    scripted = _script(_deferring_norms(layers, deferred))
    _check_layer_types(scripted)
    return scripted


def _deferring_norms(layers, deferred):
    """The Sequential `layers` with the BatchNorms inside its layers deferred (gpipe.norm) where
    `deferred` (batch_norm="deferred"); those that are layers themselves the stages defer."""
    if not deferred:
        return layers
    children = [(name, _norm.with_deferred_norms(child, top=False)) for name, child in layers.named_children()]
    if all(new is child for (_, new), child in zip(children, layers.children())):
        return layers
    changed = torch.nn.Sequential(collections.OrderedDict(children))
    changed.training = layers.training
    return changed


def _pieces_of(graph, example, deferred):
    """A traced model (gpipe.trace) as a Sequential of pieces, and the module path each starts at:
    which values are tensors is seen in one run on `example`, with its BatchNorms as the pipeline
    runs them (a SyncBatchNorm runs on the CPU deferred)."""
    kinds = _trace.value_kinds(_norm.with_deferred_norms(graph, top=False) if deferred else graph, example)
    return _trace.split(graph, kinds)


def _paths(value, name):
    """A list of module paths (split_points, keep_whole); [] for None."""
    if value is None:
        return []
    if isinstance(value, str) or not hasattr(value, "__iter__"):
        raise ValueError(f"gpipe: {name} must be a list of module paths, e.g. ['blocks.2'] (got {value!r})")
    value = list(value)
    for path in value:
        if not isinstance(path, str):
            raise ValueError(f"gpipe: every entry of {name} must be a module path, a str (got {path!r})")
    return value


_hook_installed = False


# The library's option names in its errors (`micro_batches`), as GPipe's arguments.
# The library's names of the settings as GPipe's keyword arguments (its table, settings.h).
_KEYWORD_ROWS = _gpipe.keyword_settings()  # GPipe's keyword -> (the row's name, its shape, its help)
_NAMES = {name: keyword for keyword, (name, _, _) in _KEYWORD_ROWS.items() if name != keyword}
_NAMES["deferred_batch_norm=false"] = 'batch_norm="per-micro-batch"'


def _text_of(value):
    """A keyword argument's value as the settings' table reads it: "true", "3,8", "bf16"."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def _checked_by_row(keyword, value, why="", many=False):
    """`value`, checked by the row of the settings' table (settings.h) that GPipe's keyword argument
    `keyword` fills, as gpipe train checks its flag: ValueError "gpipe: chunks must be at least 1
    (got 0)", then ": `why`" where given. A list or tuple only where `many` (the row takes a list)."""
    text = _text_of(value)
    if isinstance(value, (list, tuple)) and not many:
        raise ValueError(f"gpipe: {keyword} takes one value, not a {type(value).__name__} (got {value!r})")
    wrong = _gpipe.check_field(_KEYWORD_ROWS[keyword][0], text)
    if wrong:
        wrong = wrong.replace(f"(got {text})", f"(got {value!r})") if not many else wrong
        raise ValueError(f"gpipe: {'every entry of ' if many else ''}{keyword} {_in_python_words(wrong, _NAMES)}" +
                         (f": {why}" if why else ""))
    return value


def _keyword_settings(balance, chunks, checkpoint, schedule, devices, virtual_stages, batch_norm, threads, runtime,
                      table_settings):
    """GPipe's keyword arguments as the library's Settings: its own keywords each checked by its row of
    the settings' table (settings.h), as gpipe train checks its flag (Python's types first: a bool is
    no whole number; tensors and NumPy numbers are), and those the table adds (precision=...)."""
    if balance is not None and not isinstance(balance, (list, tuple)) and not hasattr(balance, "tolist"):
        raise ValueError(f"gpipe: balance must be a list of layers per stage, e.g. [3, 8] (got {balance!r})")
    settings = _gpipe.Settings()
    settings.balance = [] if balance is None else _checked_by_row(
        "balance", [_whole(b, "every entry of balance") for b in balance], "it is a stage's layers", many=True)
    settings.micro_batches = None if chunks is None else _checked_by_row("chunks", _whole(chunks, "chunks"))
    if schedule == "task":
        raise ValueError("gpipe: schedule=\"task\" is gpipe train's (a built-in task's own); give a schedule's name "
                         f"({', '.join(schedule_names())}) or \"auto\"")
    settings.schedule = _checked_by_row("schedule", schedule)
    if checkpoint == "auto":
        raise ValueError("gpipe: checkpoint must be always, except_last or never, or None (the default), which "
                         "lets schedule=\"auto\" choose it (got 'auto')")
    settings.checkpoint = _checked_by_row("checkpoint", checkpoint) \
        if checkpoint is not None else None if schedule == "auto" else "except_last"
    if devices is not None:
        devices = _checked_by_row(
            "devices", _whole(devices, "devices"), "it is K, the devices the pipeline runs on; give devices=1 or "
            "more (2 to pipeline over two), or leave devices=None, which takes K from the balance (2 without one)")
    settings.devices = None if devices is None and balance is not None else 2 if devices is None else devices
    if virtual_stages is not None:
        virtual_stages = _checked_by_row(
            "virtual_stages", _whole(virtual_stages, "virtual_stages"), "it is V, the stages per device; give 1 or "
            f"more, or leave virtual_stages=None for the schedule's own ({_gpipe.virtual_stages_help()})")
    settings.virtual_stages = virtual_stages
    settings.deferred_batch_norm = _checked_by_row("batch_norm", batch_norm) == "deferred"
    settings.threads = _checked_by_row("threads", _whole(threads, "threads"))
    _gpipe.check_threads_per_device(settings.threads)
    settings.runtime = _one_of(runtime, "runtime", tuple(_gpipe.runtime_names()))
    _table_settings(settings, table_settings)
    return settings


def _table_settings(settings, given):
    """Sets the keyword arguments `given` that GPipe's signature leaves to the settings' table
    (precision=...) on `settings`, each checked by its row: TypeError for a keyword no row has."""
    table = _KEYWORD_ROWS
    for keyword, value in given.items():
        if keyword not in table:
            known = sorted(set(table) | set(inspect.signature(GPipe.__init__).parameters) - {"self", "model", "settings"})
            raise TypeError(f"gpipe: GPipe() got an unexpected keyword argument {keyword!r}; it takes "
                            f"{', '.join(known)}")
        _checked_by_row(keyword, value)
        try:
            settings.set(table[keyword][0], _text_of(value))
        except ValueError as e:
            raise ValueError(_in_python_words(e, _NAMES)) from None


# Passages of the library's errors that name what only `gpipe train` has, as Python has it.
_PASSAGES = {"name a `schedule` (not auto) and give the cut (`balance`), or in gpipe train cut it by parameters "
             "(`schedule` gpipe, `balance_by` params)":
             'name a schedule (not "auto") and give the cut, layers per stage: GPipe(model, schedule="gpipe", '
             'balance=[...])',
             # GPipe's schedule= takes what gpipe train's --schedule takes but a task's own
             "must be task, auto, ": "must be auto, "}


def _in_python_words(error, names=None):
    """A library error with its option names in backquotes as the Python call's argument names."""
    names = names or {}
    message = str(error)
    for passage, python in _PASSAGES.items():
        message = message.replace(passage, python)
    return re.sub(r"`([a-z_=]+)`", lambda m: names.get(m.group(1), m.group(1)), message)


@contextlib.contextmanager
def _python_words():
    """The library's ValueErrors raised within, in GPipe's argument names."""
    try:
        yield
    except ValueError as e:
        raise ValueError(_in_python_words(e, _NAMES)) from None


def _mpi_job_size():
    """The processes of the MPI job that mpirun started this one in: 1 where no launcher started it
    (MPI's singleton, this process alone), None where one did but does not say how many."""
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    if any(os.environ.get(name) for name in ("PMIX_RANK", "MPI_LOCALNRANKS")):
        return None
    return 1


def _check_mpi_job(devices):
    """runtime="mpi": a job of K·D processes, refused at once rather than at the first batch."""
    size = _mpi_job_size()
    if size is None or size % devices == 0:
        return
    import shlex
    script = shlex.join([sys.executable] + sys.argv) if sys.argv and sys.argv[0] else "python3 script.py"
    start = f"mpirun -np {devices} {script}"
    if size == 1 and not any(os.environ.get(name) for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")):
        raise ValueError(f"gpipe: runtime=\"mpi\" runs one process per device, but mpirun did not start this one, so "
                         f"its MPI job is this process alone, one process for {devices} devices; start one per device "
                         f"under mpirun, `{start}` ({2 * devices}, {3 * devices}, ... for replicas), or leave "
                         f"runtime=\"auto\" (the default) to run the {devices} devices as threads of this process")
    raise ValueError(f"gpipe: runtime=\"mpi\" runs one process per device, and mpirun started {size} processes, not a "
                     f"multiple of the {devices} devices; start devices × replicas processes: `{start}` "
                     f"({2 * devices}, {3 * devices}, ... for replicas)")


def _end_the_job_on_an_uncaught_exception():
    """In a job of several processes (MPI, c10d), an exception that ends one rank's script ends the
    job: the other ranks would wait for that rank in their next call. A script that ends otherwise
    (its last line, sys.exit) tells the other ranks at exit: one still in a call, or making one
    later, raises RuntimeError naming this rank within a few seconds, instead of waiting for it
    forever. (In one process it changes nothing.)"""
    global _hook_installed
    if _hook_installed:
        return
    _hook_installed = True
    atexit.register(_gpipe.leave_job)
    previous = sys.excepthook

    def hook(kind, value, traceback):
        previous(kind, value, traceback)
        sys.stderr.flush()
        _gpipe.abort_job(1)

    sys.excepthook = hook


def _group_store(group):
    """The store, this process's rank, the size, the ranks (as text, to tell apart groups that share
    a store) and the default group's rank of each of torch.distributed process group `group`
    (GPipe's process_group; None: the default group, if one is initialized), or None."""
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        if group is None:
            return None
        raise ValueError("gpipe: process_group was given, but torch.distributed is not initialized in this process; "
                         "call torch.distributed.init_process_group(...) first, or give no process_group")
    from torch.distributed import distributed_c10d as c10d
    if group is None:
        group = c10d._get_default_group()
    if group is c10d.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("gpipe: this process is not a member of process_group; build the GPipe on the group's "
                         "processes only")
    world = getattr(c10d, "_world", None)  # torch 2.x; torch 1.13 keeps _pg_map
    groups = world.pg_map if world is not None else c10d._pg_map
    try:
        known = group in groups
    except TypeError:  # unhashable: not a group
        known = False
    if not known:
        raise ValueError(f"gpipe: process_group must be a torch.distributed process group of this process (one "
                         f"init_process_group or new_group made; got {type(group).__name__})")
    store = groups[group][1]
    if store is None:
        raise ValueError("gpipe: process_group has no store (an MPI group's); give a Gloo or NCCL group, whose "
                         "store gpipe keeps its keys in, or run under mpirun with runtime=\"mpi\"")
    if hasattr(dist, "get_process_group_ranks"):  # torch 1.13 and later
        ranks = dist.get_process_group_ranks(group)
    else:
        ranks = sorted(c10d._pg_group_ranks[group])
    return store, group.rank(), group.size(), "ranks " + ",".join(str(r) for r in ranks), list(ranks)


def _launched():
    """Whether mpirun or torchrun (env://) started this process as one of a job of several: its job
    is the one auto runs over, whatever torch.distributed holds."""
    if os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE"):
        return True
    return all(os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")) and \
        os.environ.get("WORLD_SIZE") != "1"


def _launcher_rank():
    """This process's rank as mpirun or torchrun set it before it started (0 where none did)."""
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def _batch(value, name):
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"gpipe: {name} must be a torch.Tensor (got {type(value).__name__})")
    if value.layout != torch.strided:
        raise ValueError(f"gpipe: the {name} is a {str(value.layout).replace('torch.', '')} tensor; gpipe splits a "
                         f"batch into micro-batches along its rows, which needs a dense one: pass {name}.to_dense()")
    return value


class _OneRowBatchNorm:
    """Turns BatchNorm's "Expected more than 1 value per channel when training" (from a layer run in
    C++ or TorchScript, RuntimeError or torch.jit.Error) into a ValueError naming chunks and the
    batch's rows. The step changed nothing (a failed step leaves parameters and gradients)."""

    def __init__(self, chunks, rows):
        self.chunks, self.rows = chunks, rows

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        if value is None or "Expected more than 1 value per channel when training" not in str(value):
            return False
        smallest = self.rows // max(1, min(self.chunks, self.rows))
        raise ValueError(
            f"gpipe: a BatchNorm layer got one value per channel: chunks={self.chunks} splits this batch of "
            f"{self.rows} rows into micro-batches of as few as {smallest} row(s), and BatchNorm normalizes each "
            f"micro-batch by its own statistics, which one row does not have; give fewer chunks or larger batches "
            f"(at least 2 rows per micro-batch), or run the model in eval mode") from None


# torch.optim's optimizers whose step updates each parameter from its own gradient, state and group
# settings alone: a stage's share of the step, run by an optimizer over that stage's parameters, is
# then the whole step's to the bit.
# id(parameter) -> the _DeviceUpdates of the update_on_devices block that holds its updates.
_HELD_BY = {}

_PER_PARAMETER = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop")
    if hasattr(torch.optim, name))


def _zero_grad_keeps_tensors(optimizer):
    """Whether optimizer.zero_grad() leaves zeros in .grad (torch 1.x: set_to_none=False) rather than None."""
    try:
        return inspect.signature(optimizer.zero_grad).parameters["set_to_none"].default is False
    except (KeyError, TypeError, ValueError):
        return False


# torch.nn.utils' clips of .grad, which find nothing within update_on_devices (the gradients are
# held): while a block is active they refuse the parameters it claims whose .grad is empty (held, or
# not yet made since), naming what clips them. Process-wide, as torch's functions are: every thread's
# clips go through the guard while any block is active (nested blocks and two pipelines' are counted).
# A clip imported by name before the block (from torch.nn.utils import clip_grad_norm_) is not seen.
_CLIPS = ("clip_grad_norm_", "clip_grad_value_")
_clips_lock = threading.Lock()
_active_blocks = 0
_torch_clips = {}      # (module, name) -> torch's function, while a block is active
_installed_clips = {}  # (module, name) -> the guard put in its place


def _refusing_held(name, clip):
    @functools.wraps(clip)
    def guarded(parameters, *args, **kwargs):
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if any(id(p) in _HELD_BY and p.grad is None for p in parameters):
            fix = "clip them with pipe.clip_grad_norm_(max_norm) after train_step, which scales the held " \
                  "gradients as clip_grad_norm_ scales .grad (the norm over every stage and rank), or " \
                  if name == "clip_grad_norm_" else ""
            raise ValueError(f"gpipe: torch.nn.utils.{name} within update_on_devices finds no gradient to clip: "
                             f"the last train_step's gradients are held for its update, which runs during the next "
                             f"train_step (.grad is None until then); {fix}call opt.zero_grad(); "
                             f"pipe.train_step(x, y); torch.nn.utils.{name}(...); opt.step() outside the block")
        return clip(parameters, *args, **kwargs)
    return guarded


def _guard_clips(entering):
    """Installs the refusing clips at the first active block, and puts torch's back after the last
    (unless something else has replaced the guard since, which is left as it is)."""
    global _active_blocks
    import torch.nn.utils.clip_grad as clip_grad
    with _clips_lock:
        _active_blocks += 1 if entering else -1
        if entering and _active_blocks == 1:
            for module in (torch.nn.utils, clip_grad):
                for name in _CLIPS:
                    _torch_clips[module, name] = getattr(module, name)
                    _installed_clips[module, name] = _refusing_held(name, _torch_clips[module, name])
                    setattr(module, name, _installed_clips[module, name])
        elif not entering and _active_blocks == 0:
            for (module, name), clip in _torch_clips.items():
                if getattr(module, name) is _installed_clips[module, name]:
                    setattr(module, name, clip)
            _torch_clips.clear()
            _installed_clips.clear()


class _DeviceUpdates:
    """A torch.optim optimizer's step split by stage (GPipe.update_on_devices): after each train_step
    the gradients are held (the parameters are left without) with the optimizer's settings of the
    moment; during the next train_step each stage's share runs on its device, before the stage's
    first action, on an optimizer of the same class over that stage's parameters that shares the
    whole one's state. Before each step the optimizer's zero_grad() runs, as the plain loop's
    opt.zero_grad() before pipe.train_step: the parameters it holds now start from its zeros (a
    parameter that joined it since the last step too, not from what it gathered while outside)."""

    def __init__(self, optimizer, model):
        owned = {id(p) for p in model.parameters()}
        if any(id(p) not in owned for group in optimizer.param_groups for p in group["params"]):
            raise ValueError("gpipe: the optimizer holds a parameter that is not the model's; update_on_devices "
                             "updates the model's parameters stage by stage: give it an optimizer of "
                             "model.parameters()")
        self.optimizer = optimizer
        self._state = optimizer.state  # the state the stages' optimizers share (load_state_dict replaces it)
        self._stages = None  # {stage: its optimizer}; made once the pipeline is cut
        self._stage_of = {}  # id(parameter) -> stage
        self._held = {}      # stage -> [(parameter, gradient)], not yet applied
        self._last_held = set()  # id(parameter) of those the last hold took
        self._keeps_zeros = _zero_grad_keeps_tensors(optimizer)
        self._claimed = [id(p) for p in model.parameters()]
        if any(_HELD_BY.get(i, self) is not self for i in self._claimed):
            raise ValueError("gpipe: another GPipe's update_on_devices block holds updates of this model's "
                             "parameters, which this pipeline would read a step behind; leave that block first")
        for i in self._claimed:
            _HELD_BY[i] = self

    def release(self):
        """The parameters no longer held by this block (its end)."""
        for i in self._claimed:
            if _HELD_BY.get(i) is self:
                del _HELD_BY[i]

    def profiled_optimizer(self):
        """The optimizer as the cost model times its update (planning's `optimizer`): "adam", "momentum"
        or "sgd"."""
        if isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
                                       torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta)):
            return "adam"
        if isinstance(self.optimizer, torch.optim.SGD) and \
                not any(group.get("momentum", 0) for group in self.optimizer.param_groups):
            return "sgd"
        return "momentum"

    def seconds_per_parameter_byte(self, model, most_bytes=256 << 20):
        """The optimizer's update timed on copies of the model's parameters (at most `most_bytes` of
        them; gradients of ones), the median of 3 steps after one, per parameter byte: what auto
        predicts of the update, torch.optim's own rather than libtorch's."""
        copies, total = [], 0
        for p in model.parameters():
            if total >= most_bytes:
                break
            flat = p.detach().flatten()[:max(1, (most_bytes - total) // p.element_size())].clone()
            flat.requires_grad_(True)
            flat.grad = torch.ones_like(flat)
            copies.append(flat)
            total += flat.numel() * flat.element_size()
        if not total:
            return 0.0
        timed = type(self.optimizer)(copies, **self.optimizer.defaults)
        seconds = []
        for _ in range(4):
            begin = time.perf_counter()
            timed.step()
            seconds.append(time.perf_counter() - begin)
        return sorted(seconds[1:])[1] / total

    def cut(self, pipe):
        """The stages' optimizers, once the pipeline is built; refuses a parameter used by two stages."""
        if self._stages is not None:
            return
        stages, stage_of = {}, {}
        for stage, parameters in sorted(pipe.stage_parameters().items()):
            for p in parameters:
                if id(p) in stage_of:
                    raise ValueError(f"gpipe: a parameter is used by stages {stage_of[id(p)]} and {stage}; "
                                     f"update_on_devices updates each stage's parameters on its own device: "
                                     f"call optimizer.step() after train_step instead")
                stage_of[id(p)] = stage
            share = object.__new__(type(self.optimizer))
            share.__setstate__({"defaults": self.optimizer.defaults, "state": self.optimizer.state,
                                "param_groups": []})
            stages[stage] = share
        self._stages, self._stage_of = stages, stage_of

    def follow_replaced_state(self):
        """If the optimizer's state was replaced (load_state_dict) since the last hold, the stages share
        the new one, and the held update, taken from the model before, is dropped, with a warning."""
        if self.optimizer.state is self._state:
            return
        self._state = self.optimizer.state
        for share in (self._stages or {}).values():
            share.state = self._state
        if self._held:
            self._held.clear()
            warnings.warn("gpipe: the optimizer's state was replaced (load_state_dict) within update_on_devices "
                          "while the last step's update was held; that update was dropped, as loading a "
                          "checkpoint would replace what it did. Load checkpoints outside the block to keep "
                          "every step's update", RuntimeWarning, stacklevel=3)

    def begin_step(self):
        """Before a step: refuses a parameter of the optimizer that is not the model's, then runs the
        optimizer's zero_grad(), as the plain loop does before pipe.train_step."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in self._stage_of and _HELD_BY.get(id(p)) is not self:
                    raise ValueError("gpipe: the optimizer holds a parameter that is not the model's (added by "
                                     "add_param_group?), which update_on_devices would never update; give it "
                                     "the model's parameters only, or call optimizer.step() outside the block")
        self.optimizer.zero_grad()

    def hold(self):
        """Takes the gradients of the step just run, with the optimizer's settings now (an LR
        scheduler's), to apply in the next; nothing may be held."""
        groups = {stage: [] for stage in self._stages}
        for group in self.optimizer.param_groups:
            settings = {k: v for k, v in group.items() if k != "params"}
            by_stage = {stage: [] for stage in self._stages}
            for p in group["params"]:
                stage = self._stage_of.get(id(p))
                if stage is None:  # another rank's
                    continue
                if p.grad is None and self._keeps_zeros and id(p) in self._last_held:
                    # The plain loop's zero_grad() left zeros in the last step's .grad, which the hold
                    # took: a parameter that got no gradient since (frozen) is stepped on those zeros.
                    p.grad = torch.zeros_like(p)
                if p.grad is not None:
                    by_stage[stage].append(p)
            for stage, params in by_stage.items():
                if params:
                    groups[stage].append(dict(settings, params=params))
        for stage, parts in groups.items():
            if not parts:
                continue
            self._stages[stage].param_groups = parts
            self._held[stage] = [(p, p.grad) for part in parts for p in part["params"]]
            for p, _ in self._held[stage]:
                p.grad = None
        self._last_held = {id(p) for pairs in self._held.values() for p, _ in pairs}
        # What optimizer.step() counts, which an LR scheduler reads.
        if hasattr(self.optimizer, "_step_count"):
            self.optimizer._step_count += 1
        if hasattr(self.optimizer, "_opt_called"):
            self.optimizer._opt_called = True

    @contextlib.contextmanager
    def exposed(self):
        """The held gradients back in .grad for the block (pipe.clip_grad_norm_ scales them in place)."""
        pairs = [pair for pairs in self._held.values() for pair in pairs]
        for p, g in pairs:
            p.grad = g
        try:
            yield
        finally:
            for p, _ in pairs:
                p.grad = None

    def apply(self, stage):
        """Stage `stage`'s share of the held update, once (a device thread calls it, holding the GIL).
        A share that fails is not tried again: its stage may be part updated."""
        held = self._held.pop(stage, None)
        if held is None:
            return
        kept = [p.grad for p, _ in held]  # the running step's, untouched before the stage's first action
        for p, g in held:
            p.grad = g
        try:
            self._stages[stage].step()
        finally:
            for (p, _), g in zip(held, kept):
                p.grad = g

    def apply_remaining(self):
        """Every share not yet applied, here; the first failure is raised once every share was tried."""
        failure = None
        for stage in sorted(self._held):
            try:
                self.apply(stage)
            except Exception as e:  # noqa: BLE001 - every share is tried, the first failure raised
                failure = failure or e
        if failure is not None:
            raise failure


class GPipe:
    """A model cut into consecutive stages over `devices` devices, trained with GPipe:
    each mini-batch split into `chunks` micro-batches that flow through the stages, the devices C++
    threads that run at the same time without the GIL (or, under mpirun, one rank each), which they
    take only for torch.optim's update within update_on_devices.

    The model's own parameters are trained in place: train_step adds to each parameter's .grad
    exactly what loss.backward() on one device would, so torch.optim optimizers, LR schedulers and
    model.state_dict() work unchanged, and so does torch.nn.utils.clip_grad_norm_ in one process
    (under MPI each rank holds only its stages' gradients: use pipe.clip_grad_norm_).

    The model is compiled (torch.jit.script) when GPipe is built (a traced model: on the first batch,
    when it is cut), and GPipe runs what it compiled:
    changes of parameter values in place (optimizers, load_state_dict), of requires_grad and of
    model.train()/model.eval() are followed; a replaced parameter or buffer (model[0].weight =
    nn.Parameter(...)), an added, replaced or removed layer (model.append, model[1] = ..., del
    model[2]) or a changed module setting (Dropout's p) are not: the next call refuses them with
    ValueError, and a new GPipe(model, ...) takes the changed model.

    A GPipe cannot be pickled (pickle, torch.save): save model.state_dict(), or pipe.save(path).

    With the defaults the first batch chooses the schedule, M, re-materialization and cut (it takes a
    few seconds, `build_seconds`, which gpipe.Summary leaves out of the step times), and the choice may
    differ from run to run where configurations are predicted alike: give schedule, chunks, checkpoint
    and balance for a run that repeats bit for bit. `with pipe.update_on_devices(opt):` runs the
    optimizer's step on the devices, as `gpipe train` does.

    model          a torch.nn.Sequential that torch.jit.script accepts (or a subclass that keeps its
                   forward): its children are the layers; or any other torch.nn.Module whose forward
                   takes one tensor and returns one: traced with torch.fx when GPipe is built and cut on
                   the first batch into pieces, the layers (gpipe.trace; `pieces` names them), each
                   compiled
    balance        layers per stage (K·V entries), or None: on the first batch, the cut predicted fastest
                   (schedule="auto") or by the layers' measured time (until then `balance` is None)
    chunks         M, micro-batches per mini-batch; None: chosen with schedule="auto", else 4 per device
                   (4·K, where the paper finds the bubble negligible)
    checkpoint     re-materialization: "always", "except_last" or "never"; None: chosen with
                   schedule="auto" (none where the memory predicted fits, else the fastest mode that
                   fits), else "except_last"
    schedule       "auto" (the default): on the first batch the layers are profiled on its micro-batches
                   and the schedule, V, M, checkpoint and cut predicted fastest at K run, each unless
                   given (over several processes rank 0 alone profiles and every rank runs its
                   choice; `schedule`, `chunks`, `checkpoint` and `predicted` say which and what it
                   expects; Ctrl-C ends the profile with KeyboardInterrupt); or one of schedule_names():
                   <schedules>
    devices        K; by default len(balance) / V, or 2 without a balance
    virtual_stages V, stages per device (<virtual_stages>)
    batch_norm     "deferred": BatchNorm's running statistics once per mini-batch from all its rows
                   (the paper's rule); "per-micro-batch": as M small batches would
    threads        intra-op threads of each device
    runtime        the backend: "threads" (this process), "mpi" (one rank per device; mpirun -np K·D), "c10d"
                   (one process per device over torch.distributed's c10d and Gloo; torchrun), or "auto": the
                   backend of the job that started this process, if it has more than one process (MPI under
                   mpirun; c10d under torchrun or with torch.distributed initialized), else threads
    split_points   a traced model's module paths where stages begin (K·V - 1 of them), in place of a
                   balance: each stage starts at the first piece at or inside its path
    keep_whole     a traced model's module paths to run whole, as one layer each (a submodule whose code fx
                   cannot follow is kept whole without being named)
    process_group  with runtime "auto" or "c10d": the torch.distributed process group whose processes run
                   the devices (rank r of the group: device r mod K of replica r div K); by default the
                   default group when torch.distributed is initialized and neither mpirun nor torchrun
                   started the process. gpipe keeps keys of its own in the group's store and sends over
                   Gloo connections of its own (the group's backend Gloo or NCCL, not MPI); the GPipe
                   objects alive in a process use the same group (after destroy_process_group, delete
                   them before building one over a new group)
<settings>
    """

    def __init__(self, model, balance=None, chunks=None, checkpoint=None, schedule="auto", devices=None,
                 virtual_stages=None, batch_norm="deferred", threads=1, runtime="auto", process_group=None,
                 split_points=None, keep_whole=None, **settings):
        _end_the_job_on_an_uncaught_exception()
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"gpipe: the model must be a torch.nn.Module (got {type(model).__name__})")
        layers = _chain_of(model)
        count, balance, split_points = self._chain_or_trace(model, layers, balance, split_points, keep_whole)
        self._split_points = split_points
        self._pieces = None  # a traced model's pieces, by the module path each starts at
        for name, p in model.named_parameters():  # every loss would be NaN, with no word why
            if p.is_floating_point() and not bool(torch.isfinite(p).all()):
                raise ValueError(f"gpipe: the model's parameter {name} holds NaN or infinite values, so every loss "
                                 f"would be NaN; initialize it anew, or load a state_dict saved before it diverged")
        settings = _keyword_settings(balance, chunks, checkpoint, schedule, devices, virtual_stages, batch_norm, threads,
                                     runtime, settings)
        if process_group is not None and runtime not in ("auto", "c10d"):
            raise ValueError(f"gpipe: process_group runs the pipeline over the c10d backend; give runtime=\"c10d\" "
                             f"or \"auto\" with it (got runtime={runtime!r})")
        # The group given; or the default group, where torch.distributed is initialized and no launcher
        # started a job of several (under mpirun, MPI's; under torchrun, its env:// job as it is).
        group = None
        if runtime in ("auto", "c10d") and (process_group is not None or not _launched()):
            group = _group_store(process_group)
        if group is not None and (group[2] > 1 or process_group is not None):
            settings.runtime = "c10d"
        else:
            group = None
        # The plan (K, V, M, the cut, the schedule) is checked now, before any work, whatever the balance.
        try:
            if chunks is None and schedule != "auto":  # 4 per device: K first, at an M every K takes
                settings.micro_batches = 4 * max(settings.devices or 0, len(settings.balance), 1)
                self.devices, _ = _gpipe.check_plan(count, settings)
                settings.micro_batches = 4 * self.devices
            self.devices, self.virtual_stages = _gpipe.check_plan(count, settings)
        except ValueError as e:
            if split_points:
                raise ValueError(f"{_in_python_words(e, _NAMES)} (GPipe(split_points={split_points!r}: "
                                 f"{len(split_points) + 1} stages, chunks={chunks!r}, devices={devices!r}, "
                                 f"schedule={schedule!r}, virtual_stages={virtual_stages!r}): K is devices, M chunks, "
                                 f"V virtual_stages; K·V stages begin at the model's start and at K·V - 1 "
                                 f"split_points)".replace("the balance's", "the split_points'")) from None
            raise ValueError(f"{_in_python_words(e, _NAMES)} (GPipe(balance={balance!r}, chunks={chunks!r}, "
                             f"devices={devices!r}, "
                             f"schedule={schedule!r}, virtual_stages={virtual_stages!r}, threads={threads!r}): "
                             f"K is devices, M chunks, V virtual_stages)") from None
        settings.devices = self.devices
        if settings.runtime == "mpi":
            _check_mpi_job(self.devices)
        self._group = group
        if group is not None:  # once the plan is accepted; again before each pipeline is built
            _gpipe.use_process_group(*group, let_go=True)
        # schedule="auto" without chunks: chosen on the first batch
        self.chunks = settings.micro_batches
        self.model = model
        self._settings = settings
        # precision="fp16" (or loss_scale="dynamic"): one loss scale for every stage and rank (train_step).
        self._scaler = _gpipe.LossScaler() if settings.scales_loss() else None
        if self._graph is not None:  # cut into pieces on the first batch, which shows what is a tensor
            settings.balance = []
            self._scripted = None
        else:
            self._scripted = _compile(layers, self._settings.deferred_batch_norm)
        self._fingerprint = _fingerprint(model)
        self._pipe = None
        self.build_seconds = 0.0  # the first batch's build of the pipeline (schedule="auto": its profile)
        self._turn = threading.RLock()  # one call at a time, with its build and its update's hold
        self._updates = None  # update_on_devices' held update
        self._step_seconds = 0.0
        if balance is not None and schedule != "auto" and self._graph is None:
            self._pipe = self._build(None)
        elif self._scripted is not None:  # built on the first batch: what it would refuse of the model, refused now
            with _python_words():
                _gpipe.check_model(self._scripted)

    def _chain_or_trace(self, model, layers, balance, split_points, keep_whole):
        """(count, balance, split_points): the layers the plan is checked with, and the balance and split
        points as given. A Sequential (or a subclass that keeps its forward) is the chain of its `layers`,
        run as they are; any other module is traced with torch.fx (self._graph, in self._trace_seconds),
        cut into pieces on the first batch: its most pieces, or with split_points one piece per stage
        (a balance of ones) until the pieces are known."""
        self._graph = None
        if layers is not None:
            if split_points is not None or keep_whole is not None:
                raise ValueError("gpipe: split_points and keep_whole are for a model that gpipe traces (one that is "
                                 "not a torch.nn.Sequential); a Sequential is cut between its children: give balance")
            return len(layers), balance, split_points
        if balance is not None:
            raise ValueError(f"gpipe: balance counts the layers of a torch.nn.Sequential; {type(model).__name__} "
                             f"is traced and cut into pieces on the first batch, so name where stages begin "
                             f"instead: split_points=['blocks.2', ...] (module paths, as model.named_modules() "
                             f"names them)")
        begin = time.perf_counter()
        with _python_words():
            self._graph = _trace.trace(model, _paths(keep_whole, "keep_whole"))
        self._trace_seconds = time.perf_counter() - begin  # the trace, then the split (bench/python_compare.py)
        split_points = _paths(split_points, "split_points")
        for path in split_points:
            _trace.check_path(model, path, "split_points")
            if split_points.count(path) > 1:
                raise ValueError(f"gpipe: split_points names {path!r} twice; each stage begins at a module of its "
                                 f"own, in the order of the forward")
        if split_points:  # checked as a balance of one piece per stage until the pieces are known
            return len(split_points) + 1, [1] * (len(split_points) + 1), split_points
        return _trace.most_pieces(self._graph), balance, split_points

    def _cut_into_pieces(self, input):
        """The traced model as a Sequential of pieces (gpipe.trace), compiled: the values that are
        tensors are known from one run on the first batch. With split_points, the balance they make."""
        begin = time.perf_counter()
        with _python_words():
            pieces, paths = _pieces_of(self._graph, input, self._settings.deferred_batch_norm)
            if self._split_points:
                self._settings.balance = _trace.balance_at(paths, self._split_points)
        pieces.training = self.model.training
        try:
            self.devices, self.virtual_stages = _gpipe.check_plan(len(pieces), self._settings)
        except ValueError as e:
            raise ValueError(f"{_in_python_words(e, _NAMES)}: the model was cut into {len(pieces)} pieces, each "
                             f"starting at a layer with only tensors alive before it ({', '.join(paths)})") from None
        self._scripted = _compile(pieces, self._settings.deferred_batch_norm)
        self._pieces = paths
        self._split_seconds = time.perf_counter() - begin  # with the compilation
        with _python_words():
            _gpipe.check_model(self._scripted)

    def _build(self, batch):
        """The pipeline of the settings (on `batch`, the first one, where it is chosen or cut there);
        the seconds it took in build_seconds."""
        begin = time.perf_counter()
        if self._group is not None:  # the backend lets go of the group's store when no pipeline uses it
            _gpipe.use_process_group(*self._group, let_go=True)
        try:
            with _python_words():
                pipe = _gpipe.Pipeline(self._scripted, self._settings, batch)
        except ValueError as e:
            if self._graph is None:
                raise
            raise ValueError(str(e).replace("(change the balance)", "(change split_points, or keep the module "
                                            "that holds it whole: keep_whole)")) from None
        self.build_seconds = time.perf_counter() - begin
        return pipe

    def _unchanged(self):
        """Refuses a call after the model changed under the pipeline, which runs what it compiled."""
        now = _fingerprint(self.model)
        if now != self._fingerprint:
            raise ValueError(f"gpipe: the model changed after GPipe was built: {_what_changed(self._fingerprint, now)}. "
                             f"GPipe runs the layers, parameters and settings it compiled when it was built, so it "
                             f"does not follow such a change: build a new GPipe(model, ...) after changing the model "
                             f"(changing parameter values in place, model.train()/eval() and requires_grad are "
                             f"followed)")

    def _ready(self, input):
        """The pipeline; without a balance it is cut by measured time on `input` (schedule="auto": chosen)."""
        _batch(input, "input")
        self._unchanged()
        with self._turn:  # another Python thread's first call waits for this one's pipeline
            if self._pipe is None:
                if input.dim() == 0:
                    raise ValueError(f"gpipe: the input has no batch dimension (shape {list(input.shape)}); give a "
                                     f"batch of rows, e.g. input.unsqueeze(0) for one sample")
                if input.size(0) == 0:
                    raise ValueError("gpipe: the first batch has no rows to measure the layers on; give at least one")
                if self._scripted is None:
                    with _OneRowBatchNorm(1, input.size(0)):  # which values are tensors: from the whole batch
                        self._cut_into_pieces(input)
                if self._updates is not None and self._settings.schedule == "auto":
                    # auto predicts the update where it will run, as long as torch.optim's takes
                    self._settings.update_on_devices = True
                    self._settings.optimizer = self._updates.profiled_optimizer()
                    self._settings.update_s_per_parameter_byte = \
                        self._updates.seconds_per_parameter_byte(self.model)
                # The profile runs backwards, whatever the caller's mode (a first pipe(x) under no_grad)
                with _OneRowBatchNorm(self.chunks or 1, input.size(0)), torch.enable_grad():
                    pipe = self._build(input)
                self.virtual_stages = pipe.virtual_stages  # schedule="auto": the V and M chosen
                self.chunks = pipe.micro_batches
                self._pipe = pipe
        return self._pipe

    def train_step(self, input, target, loss="cross_entropy"):
        """Forward and backward of the mini-batch (input, target) through the pipeline: adds the
        gradient of the mini-batch's mean loss to every parameter's .grad and returns that loss as
        a float. `loss`: "cross_entropy" (integer class targets, -100 ignored as torch's ignore_index:
        the mean over the targets not ignored of the whole mini-batch, whatever the chunks; or class
        probabilities, floating-point targets of the output's shape), "mse", or a torch.jit.script-ed
        function (output, target) -> the mean over the batch (each micro-batch weighs by its rows).
        An input that requires grad gets the gradient of that loss added to its .grad, as
        loss.backward() would (under MPI: on the ranks of the first device, their replica's rows;
        zero elsewhere). The layers run in the model's mode
        (model.train(), model.eval()). The GIL is released for the whole step; Ctrl-C raises
        KeyboardInterrupt with parameters and gradients as they were (one that comes as the step
        ends raises it after the step, which then counts).

        With a loss scale (precision="fp16", or loss_scale="dynamic": GPipe.loss_scaler), each
        micro-batch's loss is multiplied by the scale before its backward and the gradients divided
        by it after, as torch.cuda.amp.GradScaler's scale() and unscale_() do; a step whose gradients
        are not all finite, on any stage or rank, leaves every .grad None (accumulated ones too), so
        that optimizer.step() changes nothing, and the scale halves (GradScaler's rule; it doubles
        after 2000 finite steps). Keep GPipe.loss_scaler.state_dict() in your checkpoint beside the
        optimizer's, and load_state_dict() it when you resume."""
        _batch(target, "target")
        if not isinstance(loss, (str, torch.jit.ScriptFunction)):
            raise ValueError("gpipe: loss must be \"cross_entropy\", \"mse\" or a torch.jit.script-ed function "
                             "(output, target) -> scalar; decorate yours with @torch.jit.script")
        with self._turn:  # another Python thread's call waits for this step and its update's hold
            pipe = self._ready(input)
            updates = self._updates
            if updates is not None:
                updates.cut(pipe)
                updates.follow_replaced_state()
                updates.begin_step()
            begin = time.perf_counter()
            hold = False  # whether this step's gradients are held for the next step's update
            scaler = self._scaler
            skipped = scaler.skipped if scaler is not None else 0
            try:
                with _OneRowBatchNorm(self.chunks, input.size(0) if input.dim() else 0):
                    value = pipe.train_step(input, target, loss, self.model.training, scaler)
                # A step the loss scale skipped holds no update: its gradients are None everywhere.
                hold = scaler is None or scaler.skipped == skipped
            finally:
                if updates is not None:
                    try:  # what the devices did not apply (after a failed step: the last step's update, whole)
                        updates.apply_remaining()
                    finally:
                        if hold:  # this step's gradients held for the next, even if the last update failed
                            updates.hold()
                            pipe.set_before_stage(updates.apply)
            self._step_seconds = time.perf_counter() - begin
            if pipe.take_interrupt():  # Ctrl-C as the step ended: after it (and its hold), which count
                raise KeyboardInterrupt
            return value

    @property
    def loss_scaler(self):
        """The loss scale of precision="fp16" (or loss_scale="dynamic"): a gpipe.LossScaler, as
        torch.cuda.amp.GradScaler keeps one (scale, growth_tracker, skipped, state_dict(),
        load_state_dict()); None where the pipeline scales no loss. Assign a gpipe.LossScaler of your
        own to set GradScaler's options (init_scale, growth_factor, backoff_factor, growth_interval);
        whether a loss is scaled at all is GPipe's precision= and loss_scale=, the same on every rank."""
        return self._scaler

    @loss_scaler.setter
    def loss_scaler(self, scaler):
        if self._scaler is None:
            raise ValueError("gpipe: this pipeline scales no loss; give GPipe(..., precision=\"fp16\") or "
                             "loss_scale=\"dynamic\" to scale it")
        if not isinstance(scaler, _gpipe.LossScaler):
            raise TypeError(f"gpipe: loss_scaler must be a gpipe.LossScaler (got {type(scaler).__name__}); "
                            f"load a saved state with pipe.loss_scaler.load_state_dict(state)")
        with self._turn:  # not while a step changes it
            self._scaler = scaler

    @contextlib.contextmanager
    def update_on_devices(self, optimizer):
        """Within the block, each train_step also takes `optimizer`'s step, and each stage's share of it
        runs on the stage's device during the next train_step, before the stage's first action, while
        the devices would wait for the pipeline to fill (gpipe train's default), instead of on the
        calling thread while every device waits:

            with pipe.update_on_devices(opt):
                for x, y in loader:
                    loss = pipe.train_step(x, y)   # then no opt.zero_grad() or opt.step() is needed

        The parameters and the optimizer state are then exactly those of opt.zero_grad();
        pipe.train_step(x, y); opt.step(): each train_step runs opt.zero_grad() first, and each
        update takes the optimizer's settings and parameters (param_groups: an LR scheduler's rate,
        groups added or removed) as they are when its train_step returns. Within the block a step's
        update is held until the next train_step, so the parameters and opt.state_dict() read
        directly lag one update behind; pipe(x), pipe.save and leaving the block apply it first.
        The held gradients leave .grad None: opt.zero_grad() and opt.step() find nothing to do.
        pipe.clip_grad_norm_(max_norm) after train_step clips the held gradients, as
        torch.nn.utils.clip_grad_norm_ before opt.step() would clip .grad; torch.nn.utils'
        clip_grad_norm_ and clip_grad_value_ refuse the held parameters with ValueError while a
        block is active (a copy of them bound before the block, `from torch.nn.utils import
        clip_grad_norm_`, clips nothing: use pipe.clip_grad_norm_, or call opt.step() outside the
        block). `optimizer`: one of torch.optim's per-parameter optimizers (SGD, Adam, AdamW,
        Adagrad, Adadelta, Adamax, ASGD, NAdam, RAdam, RMSprop) of the model's parameters, without
        step hooks of its own (a global one, torch.optim.optimizer.register_optimizer_step_pre_hook,
        runs once per stage). A failed train_step leaves the parameters as the last step left them;
        a stage's share that fails is not tried again (that stage may be part updated)."""
        if type(optimizer) not in _PER_PARAMETER:
            raise ValueError(f"gpipe: update_on_devices takes one of torch.optim's per-parameter optimizers "
                             f"({', '.join(c.__name__ for c in _PER_PARAMETER)}), whose step a stage can take for "
                             f"its own parameters (got {type(optimizer).__name__}); call optimizer.step() after "
                             f"train_step instead")
        if getattr(optimizer, "_optimizer_step_pre_hooks", None) or \
                getattr(optimizer, "_optimizer_step_post_hooks", None):
            raise ValueError("gpipe: the optimizer has step hooks, which a stage's share of its step would not run; "
                             "call optimizer.step() after train_step instead")
        with self._turn:
            if self._updates is not None:
                raise ValueError("gpipe: update_on_devices is already active for this GPipe; leave the first block "
                                 "first")
            updates = _DeviceUpdates(optimizer, self.model)
            try:
                if self._pipe is not None:
                    updates.cut(self._pipe)
            except BaseException:
                updates.release()
                raise
            self._updates = updates
            _guard_clips(True)
        try:
            yield self
        finally:
            with self._turn:
                try:
                    self._finish_update()
                finally:
                    self._updates = None
                    try:
                        updates.release()
                    finally:
                        _guard_clips(False)

    def _finish_update(self):
        """The held update (update_on_devices) applied here, before the parameters are read or used."""
        with self._turn:
            if self._updates is None:
                return
            if self._pipe is not None:
                self._pipe.set_before_stage(None)
            self._updates.follow_replaced_state()
            self._updates.apply_remaining()

    def __reduce__(self):
        raise TypeError("gpipe: a GPipe cannot be pickled or saved with torch.save (it holds a compiled pipeline "
                        "and, under MPI, its ranks' connections); save the model's parameters instead: "
                        "torch.save(model.state_dict(), path) (or pipe.save(path) for the whole model as "
                        "TorchScript), and build a new GPipe around the model after loading them")

    def __call__(self, input):
        """Pipelined inference in the model's current train/eval mode, keeping no autograd graph (in
        training mode BatchNorm's running statistics are updated once from every row, as by
        train_step; with batch_norm="per-micro-batch", once per micro-batch): the output (under MPI: on the rank of each replica's last stage, its replica's rows; None on
        the other ranks)."""
        with self._turn:
            pipe = self._ready(input)
            self._finish_update()
            with _OneRowBatchNorm(self.chunks, input.size(0) if input.dim() else 0):
                return pipe.forward(input, self.model.training)

    forward = __call__

    def output_rows(self, rows):
        """The rows of a batch of `rows` that pipe(x) returns here, as a slice of the batch: all of
        them in one process; under MPI with replicas, this rank's replica's share (empty where the
        rank returns None). E.g. correct = (pipe(x).argmax(1) == y[pipe.output_rows(len(y))]).sum()."""
        first, count = (0, rows) if self._pipe is None else self._pipe.output_rows(_whole(rows, "rows"))
        return slice(first, first + count)

    @property
    def gil_share(self):
        """The share of the last train_step's wall time in which gpipe held the GIL, its devices'
        torch.optim update within update_on_devices included (the rest, the devices' own work, other
        Python threads could run)."""
        if self._pipe is None or not self._step_seconds:
            return 0.0
        return max(0.0, 1.0 - self._pipe.gil_free_seconds / self._step_seconds)

    @property
    def balance(self):
        """Layers per stage: the balance given, or, without one, None until the first batch cuts the model."""
        if self._pipe is None:
            return list(self._settings.balance) or None
        return list(self._pipe.balance)

    @property
    def pieces(self):
        """A traced model's pieces, each named by the module path it starts at (the layers the balance
        counts); None for a torch.nn.Sequential, or until the first batch cuts a traced model."""
        return list(self._pieces) if self._pieces is not None else None

    @property
    def schedule(self):
        """The schedule run ("auto": the one chosen); None until the pipeline is built."""
        return None if self._pipe is None else self._pipe.schedule

    @property
    def config(self):
        """The pipeline that runs, as a gpipe.PipelineConfig (schedule, devices, virtual_stages, micro_batches,
        balance, checkpoint and the stage_times its V schedule is ordered by; fields() as a dict): with
        schedule="auto", the one chosen; the same on every rank. None until the pipeline is built."""
        return None if self._pipe is None else self._pipe.config

    @property
    def checkpoint(self):
        """The re-materialization run ("always", "except_last" or "never"; checkpoint=None with
        schedule="auto": the one chosen); None until the pipeline is built."""
        return None if self._pipe is None else self._pipe.checkpoint

    @property
    def predicted(self):
        """schedule="auto": (step seconds, bubble) the cost model predicted of the choice (rank 0's,
        over several processes); None otherwise or before the first batch."""
        if self._pipe is None or self._settings.schedule != "auto":
            return None
        return tuple(self._pipe.predicted)

    @property
    def placement(self):
        """The device of each stage (stage s on device s mod K, or placed as a V); None until the pipeline is built."""
        return None if self._pipe is None else list(self._pipe.placement)

    @property
    def bubble(self):
        """The last step's measured bubble: the share of device time spent idle (collective under MPI)."""
        return 0.0 if self._pipe is None else self._pipe.bubble()

    def trace(self, path):
        """Writes the last step's timeline: an SVG chart if `path` ends in .svg (in any case), else
        Chrome-trace JSON (open it in Perfetto). Under MPI every rank calls it; rank 0 writes."""
        path = _path(path, "the trace's path")
        if self._pipe is None or not self._pipe.has_trace:
            raise ValueError("gpipe: no step has run yet, so there is no timeline to write")
        self._pipe.write_trace(path)

    def schedule_text(self):
        """The schedule as a grid: one row per device, one column per time slot."""
        if self._pipe is None:
            raise ValueError("gpipe: the schedule is decided with the cut, on the first batch (balance=None)")
        return self._pipe.schedule_text()

    def clip_grad_norm_(self, max_norm):
        """torch.nn.utils.clip_grad_norm_ over the whole model: the norm over every stage (every rank
        under MPI); scales the gradients down to `max_norm` if above it. Returns the norm before.
        Within update_on_devices it scales the gradients the last train_step left for its update
        (held, .grad None), as it would scale .grad before opt.step() in the plain loop."""
        if self._pipe is None:
            return 0.0
        with self._turn:
            with self._updates.exposed() if self._updates is not None else contextlib.nullcontext():
                return self._pipe.clip_grad_norm(float(max_norm))

    def save(self, path):
        """Writes the whole model to one file, gathered from every rank under MPI (every rank calls
        it; rank 0 writes, and its model then holds every rank's values): TorchScript, which
        torch.jit.load reads (model.load_state_dict(torch.jit.load(path).state_dict()) takes a
        Sequential's back; a traced model's parameters are named by piece, then by path: see gpipe.export; `import
        gpipe` first if the model has Stash and Pop layers or BatchNorms inside layers), written whole
        or not at all. Optimizer state is not in it: torch.save(opt.state_dict()) saves that."""
        path = _path(path, "the model's path")
        if self._pipe is None:
            raise ValueError("gpipe: the pipeline is built on the first batch (balance=None); train a step first")
        self._unchanged()
        with self._turn:
            self._finish_update()
            self._pipe.save(path)

    def parameters(self):
        """The parameters this process trains (all of them in one process; under MPI this rank's
        stages'): the model's own Parameter objects. An optimizer may as well take
        model.parameters(): under MPI the other ranks' parameters get no gradient, and torch.optim
        leaves them alone."""
        if self._pipe is None:
            raise ValueError("gpipe: with balance=None or schedule=\"auto\" the pipeline is built on the first batch, "
                             "so which parameters this process trains is not known yet; build the optimizer on "
                             "model.parameters()")
        return list(self._pipe.parameters())

    def describe(self):
        """Where the devices run: "one process, 2 device threads" or "MPI: 4 ranks = 2 devices x 2 replicas"."""
        return "not built yet" if self._pipe is None else self._pipe.describe()

    def sum(self, value):
        """`value` summed over every rank of an MPI job (collective; `value` itself in one process):
        e.g. the correct predictions that each rank holding outputs counted."""
        return value if self._pipe is None else self._pipe.sum(float(value))

    @property
    def rank(self):
        """This process's rank in its job (MPI, c10d; 0 in one process): rank 0 prints. Before the pipeline
        is built (on the first batch), the rank its group or its launcher gives."""
        if self._pipe is not None:
            return self._pipe.rank
        if self._group is not None:
            return self._group[1]
        return _launcher_rank() if self._settings.runtime != "threads" and _launched() else 0


def _help_line(keyword, help):
    """A keyword argument's help as GPipe's docstring lists them: its name, then its help in lines of
    at most 104 characters, the library's names of other settings as Python's."""
    words = re.sub(r"`([a-z_]+)`", lambda m: _NAMES.get(m.group(1), m.group(1)), help).split()
    lines, line = [], f"    {keyword:<15}"
    for word in words:
        if len(line) + 1 + len(word) > 104:
            lines.append(line)
            line = " " * 19 + word
        else:
            line += ("" if line.endswith(" ") else " ") + word
    return "\n".join(lines + [line])


# The schedules in GPipe's help as the library's registry describes them, so that none is listed by hand
# (no docstrings under python -OO).
if GPipe.__doc__:
    GPipe.__doc__ = GPipe.__doc__.replace("<schedules>", _gpipe.schedule_help()) \
        .replace("<virtual_stages>", _gpipe.virtual_stages_help()) \
        .replace("<settings>", "\n".join(
            _help_line(keyword, help) for keyword, (name, _, help) in _gpipe.keyword_settings().items()
            if keyword not in inspect.signature(GPipe.__init__).parameters))


def export(model, example, path, keep_whole=None, batch_norm="deferred"):
    """Writes `model` to `path` as the TorchScript Sequential that `gpipe train --model PATH` trains
    (written whole or not at all): a torch.nn.Sequential as it is, any other module traced and cut
    into pieces as GPipe cuts it, `example` (a batch) showing which values are tensors. With
    batch_norm="deferred", the BatchNorms inside layers are written as gpipe.norm's DeferredBatchNorm,
    which gpipe train defers (its --batch-norm per-micro-batch runs them as BatchNorm). Each
    parameter is named by its piece, then its path in the model: gpipe train --save writes them so,
    and model.load_state_dict({k.partition(".")[2]: v for k, v in torch.jit.load(p).state_dict().items()})
    reads a traced model's back (a parameter two pieces share comes twice, with one value)."""
    path = _path(path, "the model's path")
    _checked_by_row("batch_norm", batch_norm)
    deferred = batch_norm == "deferred"
    layers = _chain_of(model)
    if layers is None:
        with _python_words():
            layers, _ = _pieces_of(_trace.trace(model, _paths(keep_whole, "keep_whole")), _batch(example, "example"),
                                   deferred)
        layers.training = model.training
    buffer = io.BytesIO()
    torch.jit.save(_compile(layers, deferred), buffer)
    with _python_words():
        _gpipe.write_file_atomically(path, buffer.getvalue())
