"""Launching kernels/cross_entropy.cu (and its Numba twin): the fused softmax cross-entropy.

    ce = cb.load_launch("cross_entropy")
    loss, dz = ce.cross_entropy(z, labels)               # mean over rows; dz = d loss / d z
    ce.cross_entropy(z, labels, loss=loss, dz=dz)        # into preallocated buffers (graphs)
    ce.cross_entropy_numba(z, labels, loss, dz)          # the Numba twin (simulator or GPU)

    VERSIONS, REDUCTIONS           the kernels (float32, float64); "mean" or "sum"
    config(M, version)             -> Launch(grid, block=128, kernel=version): a warp per row
    cross_entropy(z, labels, loss=None, dz=None, reduction, check_labels, version)
                                   the entry point: checks, config, launch, returns (loss, dz)
    cross_entropy_numba(...)       the Numba twin, cross_entropy_thread_per_row
    sanitize_targets()

z is (M, C) float32 (cross_entropy_v1) or float64 (cross_entropy_f64); labels (M,) int32 (int64,
PyTorch's default, is converted once). The checks, before anything is launched: z C-contiguous on
the GPU, not empty, fewer than 2^31 elements; labels int32 (M,); loss (1,) and dz (M, C) of z's
dtype (allocated by z's library when not given); dz not overlapping z. A label outside [0, C)
gives a NaN loss, never a number (``check_labels`` refuses it instead).
"""

from __future__ import annotations

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div, version_name
from cudabook.validate import dtype_name

__all__ = ["VERSIONS", "REDUCTIONS", "cross_entropy", "cross_entropy_numba", "config",
           "sanitize_targets"]

VERSIONS = ("cross_entropy_v1", "cross_entropy_f64")
REDUCTIONS = ("mean", "sum")
_KERNELS = {"float32": "cross_entropy_v1", "float64": "cross_entropy_f64"}


def _module():
    return cb.module("cross_entropy")     # the whole file, compiled once per process


def config(M: int, version: str = "cross_entropy_v1") -> Launch:
    """Grid and block of ``version`` for M rows: 4 warps per block, one row each."""
    version = version_name(VERSIONS, version, "cross_entropy")
    return Launch((ceil_div(M, 4),), (128,), kernel=version)


def _ptr_range(a) -> tuple[int, int] | None:
    info = cb.describe(a)
    return (info.ptr, info.ptr + info.size * info.itemsize) if info.ptr else None


def _check(z, labels, loss, dz, reduction: str) -> tuple[int, int, str]:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    cb.expect(z, "z", ndim=2)
    dt = dtype_name(z.dtype)
    if dt not in _KERNELS:
        raise TypeError(f"z: expected float32 or float64, got {dt} (use .astype(float32))")
    M, C = (int(s) for s in z.shape)
    if M == 0 or C == 0:
        raise LaunchError(f"cross_entropy: empty logits, shape {(M, C)}")
    if M * C >= 2**31:
        raise LaunchError(f"cross_entropy: {M} x {C} >= 2^31 elements (the kernel indexes rows "
                          "with int C)")
    cb.expect(labels, "labels", dtype=np.int32, shape=(M,))
    if loss is not None:
        cb.expect(loss, "loss", dtype=dt, shape=(1,))
    if dz is not None:
        cb.expect(dz, "dz", dtype=dt, shape=(M, C))
        rz, rd = _ptr_range(z), _ptr_range(dz)
        if rz and rd and rz[0] < rd[1] and rd[0] < rz[1]:
            raise ValueError("dz overlaps z: the kernel reads every z of a row after writing "
                             "part of dz, so the gradient must go to a separate buffer")
    return M, C, dt


def cross_entropy(z, labels, loss=None, dz=None, reduction: str = "mean",
                  check_labels: bool = False, version: str | None = None):
    """(loss, dz): the softmax cross-entropy of logits ``z`` with integer ``labels`` and its
    gradient, in one launch. ``loss`` (1,) is zeroed and then accumulated; pass ``dz=False`` for
    the loss alone. A label outside [0, C) makes the loss NaN and that row of ``dz`` NaN (the
    kernel cannot raise); ``check_labels`` copies the labels to the host and refuses them instead
    (not inside a CUDA graph capture). PyTorch's int64 labels are converted to int32 once (a
    copy: pass int32 labels inside a graph capture). ``version``: the kernel of z's dtype
    (cross_entropy_v1 for float32, cross_entropy_f64 for float64), checked when given."""
    want_dz = dz is not False
    dz = None if dz is False else dz
    labels = _int32_labels(labels)
    M, C, dt = _check(z, labels, loss, dz, reduction)
    kernel = _KERNELS[dt]
    if version is not None and version_name(VERSIONS, version, "cross_entropy") != kernel:
        raise TypeError(f"cross_entropy: {version} does not take {dt} logits; {kernel} does")
    if check_labels:
        lab = cb.to_numpy(labels)
        if lab.min() < 0 or lab.max() >= C:
            raise ValueError(f"labels must lie in [0, {C}); found {lab.min()}..{lab.max()}")
    if loss is None:
        loss = cb.arrays.empty_like_lib(z, (1,), dt)
    if want_dz and dz is None:
        dz = cb.arrays.empty_like_lib(z, (M, C), dt)
    scale = (1.0 / M) if reduction == "mean" else 1.0
    no_dz = np.uint64(0)          # a null pointer, 8 bytes like the pointer it stands for
    cfg = config(M, kernel)
    with cb.arrays.launch_stream(z, labels, loss):
        lossc = cb.as_cupy(loss, "loss")
        lossc.fill(0)
        cb.launch.run(_module().get(kernel), cfg,
                      (cb.as_cupy(z, "z"), cb.as_cupy(labels, "labels"), lossc,
                       cb.as_cupy(dz, "dz") if want_dz else no_dz, np.int32(M), np.int32(C),
                       np.dtype(dt).type(scale)))
    return loss, (dz if want_dz else None)


def _int32_labels(labels):
    """int64 labels (PyTorch's default) as an int32 copy; anything else as it is (checked later).
    An id that int32 cannot hold is out of range for any C, so it is refused here."""
    if dtype_name(getattr(labels, "dtype", "")) != "int64" or \
            not cb.describe(labels, "labels").on_device:
        return labels
    lab = cb.as_cupy(labels, "labels")
    if lab.size and (int(lab.min()) < -2**31 or int(lab.max()) >= 2**31):
        raise ValueError("labels: an int64 label outside int32's range cannot be a class index")
    return lab.astype(np.int32)


def cross_entropy_numba(z, labels, loss, dz, reduction: str = "mean") -> None:
    """The Numba twin, ``cross_entropy_thread_per_row``: loss (zeroed here) and dz."""
    M, _, _ = _check(z, labels, loss, dz, reduction)
    nb = cb.load_numba("cross_entropy")
    if hasattr(loss, "copy_to_device"):           # a Numba device array
        loss.copy_to_device(np.zeros(1, loss.dtype))
    else:
        loss[...] = 0
    scale = (1.0 / M) if reduction == "mean" else 1.0
    nb.cross_entropy_thread_per_row[ceil_div(M, 64), 64](z, labels, loss, dz, scale)


def sanitize_targets():
    """Both kernels on a ragged shape, C above one warp's width (memcheck: the row guard)."""
    import cupy as cp

    z = cp.random.standard_normal((7, 45), dtype=cp.float32)
    lab = cp.random.randint(0, 45, 7).astype(cp.int32)
    yield "cross_entropy_v1 (7x45)", (lambda: cross_entropy(z, lab))
    z64 = z.astype(cp.float64)
    yield "cross_entropy_f64 (7x45)", (lambda: cross_entropy(z64, lab))
