"""The built-in tasks (include/gpipe/tasks.h): the models `gpipe train --model` trains, with their
data, loss, metric and references, and the benchmark workloads.

    import gpipe
    gpipe.tasks.names()                                   # ['cnn', 'resnet', 'unet', 'gpt']
    data = gpipe.tasks.data("gpt", test_samples=64)
    x, y = data.train                                     # the training windows and their next bytes
    print(data.bigram_bits_per_byte, data.gzip_bits_per_byte)
    gpipe.plan(task="gpt", devices=4, batch=16)           # the planner on the task's own model

The tasks' models are C++ modules (include/gpipe/models.h), which cannot become Python modules:
gpipe.tasks.model returns what can cross, each layer's kind and the model's parameters and buffers
by name (its state), not a torch.nn.Sequential.
"""
import collections
import dataclasses
import numbers
import os
from typing import Dict, List, Optional, Tuple

import torch

from . import _gpipe
from .pipe import _one_of
from .planning import _call, _seed


@dataclasses.dataclass(frozen=True)
class TaskData:
    """A task's data: train and test as (input, target) tensors; test_name ("test", or "training"
    for a task scored on its training data); source (where the data came from); the references of
    its metric: noisy_psnr_db (unet: the PSNR of the noisy test images, the score of doing nothing),
    bigram_bits_per_byte and gzip_bits_per_byte (gpt: a bigram model's and gzip -9's bits per byte
    on the test bytes scored), train_bytes and test_bytes (gpt: the text's bytes); 0 where the task
    has no such reference."""
    train: Tuple[torch.Tensor, torch.Tensor]
    test: Tuple[torch.Tensor, torch.Tensor]
    test_name: str
    source: str
    noisy_psnr_db: float
    train_bytes: int
    test_bytes: int
    bigram_bits_per_byte: float
    gzip_bits_per_byte: float


@dataclasses.dataclass(frozen=True)
class TaskModel:
    """A task's model as far as it crosses into Python (its layers are C++ modules): name, layers
    (each top-level layer's C++ kind, e.g. "torch::nn::Conv2dImpl"), loss ("cross_entropy" or
    "mse"), metric ("accuracy", "psnr_db", "bits_per_byte", "loss"), parameters (elements) and state
    (an OrderedDict of every parameter and buffer by name, as a C++ module names them, e.g.
    "0.weight": the values of the model drawn from `seed`)."""
    name: str
    layers: List[str]
    loss: str
    metric: str
    parameters: int
    state: Dict[str, torch.Tensor]


def names(workloads=False):
    """The built-in tasks (cnn, resnet, unet, gpt), and with workloads=True the benchmark workloads
    after them (mlp, transformer, tiny, ...)."""
    return list(_gpipe.task_names(bool(workloads)))


def _task(name):
    if not isinstance(name, str):
        raise ValueError(f"gpipe: name must be a task's name, a str (got {type(name).__name__})")
    return _one_of(name, "name", tuple(names(workloads=True)))


def _samples(value, name):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0 or value >= 2**63:
        raise ValueError(f"gpipe: {name} must be a whole number, at least 0 (0: all) (got {value!r})")
    return int(value)


def info(name):
    """What the registry says of task `name`: a dict of name, title, summary, workload (a benchmark
    workload), layers, metric, loss, data_dir (where its data is read from; "" for one that makes
    its data), context (gpt: the bytes a sample holds) and defaults (epochs, batch_size, lr, flip,
    cut_by_time: what `gpipe train --model NAME` runs with)."""
    return dict(_gpipe.task_info(_task(name)))


def data(name, data_dir=None, train_samples=0, test_samples=0, seed=0):
    """Reads (or makes) task `name`'s data: a TaskData. data_dir: where to read it (None: the
    task's own, e.g. /usr/share/datasets/fashion-mnist, /usr/share/games/fortunes);
    train_samples, test_samples: only the first N of each (0: all); seed: the random parts (the
    U-Net's noise, a workload's batch). ValueError for arguments that cannot work, RuntimeError
    naming the folder or file that cannot be read and the fix."""
    name = _task(name)
    if data_dir is not None and not isinstance(data_dir, (str, os.PathLike)):
        raise ValueError(f"gpipe: data_dir must be a folder's path, a str or os.PathLike (got {type(data_dir).__name__})")
    folder = "" if data_dir is None else os.fspath(data_dir)
    if data_dir is not None and not folder:
        raise ValueError("gpipe: data_dir is empty; give a folder, or None for the task's own")
    d = _call(_gpipe.task_data, name, folder, _samples(train_samples, "train_samples"),
              _samples(test_samples, "test_samples"), _seed(seed))
    d["train"], d["test"] = tuple(d["train"]), tuple(d["test"])
    return TaskData(**d)


def model(name, seed=0):
    """Task `name`'s model drawn from `seed`, as far as it crosses into Python: a TaskModel (each
    layer's kind, its loss and metric, and its parameters and buffers by name). Not a
    torch.nn.Sequential: the tasks' layers are C++ modules, which Python cannot call."""
    name = _task(name)
    built = _call(_gpipe.task_model, name, _seed(seed))
    task = _gpipe.task_info(name)
    state = collections.OrderedDict((key, value) for key, value in built["state"])
    return TaskModel(name, list(built["layers"]), task["loss"], task["metric"], built["parameters"], state)


__all__ = ["TaskData", "TaskModel", "data", "info", "model", "names"]
