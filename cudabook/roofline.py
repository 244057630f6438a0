"""Roofline arithmetic: the work and the compulsory memory traffic of an operation, and its
arithmetic intensity (flops per byte), from which the roofline bounds its speed."""

from __future__ import annotations

__all__ = ["gemm_flops", "gemm_min_bytes", "intensity"]


def gemm_flops(M: int, N: int, K: int) -> float:
    """Flops of C[M, N] = A[M, K] @ B[K, N]: one multiply and one add per term."""
    return 2.0 * M * N * K


def gemm_min_bytes(M: int, N: int, K: int, itemsize: int = 4) -> float:
    """Compulsory traffic of a GEMM: read A and B once, write C once."""
    return float(itemsize) * (M * K + K * N + M * N)


def intensity(flops: float, nbytes: float) -> float:
    """Arithmetic intensity in flop/byte."""
    if nbytes <= 0:
        raise ValueError(f"intensity: bytes must be > 0, got {nbytes!r}")
    return flops / nbytes
