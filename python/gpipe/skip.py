"""Skip connections across stages: Stash and Pop layers of a torch.nn.Sequential.

    model = torch.nn.Sequential(conv1, gpipe.Stash("e1"), pool, conv2, up, gpipe.Pop("e1", "concat"), conv3)

A Stash passes its input on and keeps it under a name; the Pop of that name (a later layer, on the
same stage or any later one) merges it into its input: "add" (a residual), "concat" (channels, dim
1, as a U-Net's long skip) or a module of your own. The pipeline sends the stashed tensor straight from the stashing stage
to the popping one, and its gradient straight back. Outside a pipeline (plain PyTorch, one thread)
they work as the model's forward: the Pop takes what the Stash kept. Both must be children of the
Sequential itself, each name stashed once and popped once, the pop after the stash.
"""
import torch

from . import _gpipe  # noqa: F401  (registers torch.ops.gpipe.stash and pop)


class Stash(torch.nn.Module):
    name: str

    def __init__(self, name: str):
        super().__init__()
        if not isinstance(name, str) or not name:
            raise ValueError(f"gpipe: a Stash needs a name, the one its Pop takes (got {name!r})")
        self.name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.gpipe.stash(self.name, x)


class Add(torch.nn.Module):
    """A residual connection: x + skip."""

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return x + skip


class Concat(torch.nn.Module):
    """A U-Net's long skip: the channels (dim 1) of x, then of skip."""

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, skip], 1)


class Pop(torch.nn.Module):
    name: str

    def __init__(self, name: str, merge="add"):
        """`merge`: "add", "concat", or a module whose forward(x, skip) merges them (scriptable,
        without parameters: it runs inside the Pop's stage, e.g. a shortcut that subsamples)."""
        super().__init__()
        if not isinstance(name, str) or not name:
            raise ValueError(f"gpipe: a Pop needs a name, the one its Stash took (got {name!r})")
        if isinstance(merge, str):
            if merge not in ("add", "concat"):
                raise ValueError(f"gpipe: Pop({name!r}) merges by \"add\", \"concat\" or a module (got {merge!r})")
            merge = Add() if merge == "add" else Concat()
        if not isinstance(merge, torch.nn.Module):
            raise ValueError(f"gpipe: Pop({name!r}): merge must be \"add\", \"concat\" or a torch.nn.Module with "
                             f"forward(x, skip) (got {type(merge).__name__})")
        self.name = name
        self.merger = merge

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.merger(x, torch.ops.gpipe.pop(self.name))
