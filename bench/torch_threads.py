"""set_threads: the thread settings every PyTorch contender of the bench scripts runs with."""
import ctypes


def set_threads(n):
    """Intra-op threads and OpenBLAS threads alike, as gpipe sets them (OpenBLAS' pool ignores torch's)."""
    import torch
    torch.set_num_threads(n)
    blas = getattr(ctypes.CDLL("libblas.so.3"), "openblas_set_num_threads", None)  # the one torch loaded
    if blas is not None:
        blas(n)
