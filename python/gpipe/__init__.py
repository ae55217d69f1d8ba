"""gpipe: GPipe pipeline parallelism for PyTorch models, its devices C++ threads that take the GIL only for
torch.optim's update within GPipe.update_on_devices.

    import torch, gpipe
    pipe = gpipe.GPipe(torch.nn.Sequential(...), chunks=4, devices=2)
    loss = pipe.train_step(x, y, loss="cross_entropy")   # grads in the model's .grad, as loss.backward()
    opt.step()

See GPipe, and the README's "Python" section.
"""
import os
import sys

import torch  # first: the extension uses the libtorch that torch has loaded

# Open MPI loads its components as plugins that need libmpi's symbols: the extension (which links
# libmpi) is loaded with them global, as a program started by mpirun would have them.
_flags = sys.getdlopenflags()
sys.setdlopenflags(_flags | os.RTLD_GLOBAL)
try:
    from . import _gpipe
finally:
    sys.setdlopenflags(_flags)

from .pipe import GPipe, schedule_names  # noqa: E402
from .planning import plan, predict, profile  # noqa: E402
from . import tasks  # noqa: E402
from .report import Summary  # noqa: E402
from .skip import Pop, Stash  # noqa: E402

__all__ = ["GPipe", "Pop", "Stash", "Summary", "plan", "predict", "profile", "schedule_names", "tasks"]
