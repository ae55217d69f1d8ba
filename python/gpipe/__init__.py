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

from ._gpipe import LossScaler, PipelineConfig, blas_gflops, blas_kernel  # noqa: E402
from .norm import DeferredBatchNorm  # noqa: E402
from .pipe import GPipe, export, schedule_names  # noqa: E402
from .planning import plan, predict, profile  # noqa: E402
from . import tasks  # noqa: E402
from .report import Summary  # noqa: E402
from .skip import Pop, Stash  # noqa: E402

__all__ = ["DeferredBatchNorm", "GPipe", "LossScaler", "PipelineConfig", "Pop", "Stash", "Summary", "blas_gflops",
           "blas_kernel", "export", "plan", "predict", "profile", "schedule_names", "tasks"]


def _warn_of_a_generic_blas_kernel():
    """Once, at import: torch has loaded OpenBLAS, which reads OPENBLAS_CORETYPE only then, so where it
    fell back to a generic kernel on a CPU with AVX2 or AVX-512, gpipe can only name the variable to
    export. GPIPE_BLAS_CORETYPE=keep silences it; a value gpipe does not take raises, naming the choices."""
    import warnings
    advice = _gpipe.blas_warning()
    from .pipe import _launcher_rank
    if advice and _launcher_rank() == 0:  # the first process of a job says it for all
        warnings.warn(advice, RuntimeWarning, stacklevel=3)


_warn_of_a_generic_blas_kernel()
