"""Float64 references: what every kernel of the book is checked against (lessons, tests, graders).

Each takes host arrays (numpy; anything ``np.asarray`` accepts) and returns a float64 numpy array.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["softmax_reference", "layernorm_reference", "rmsnorm_reference",
           "conv1d_reference", "conv2d_reference", "gelu_tanh_reference", "gelu_erf_reference",
           "matmul_reference"]


def softmax_reference(x) -> np.ndarray:
    """Row-wise softmax in float64; a row of only -inf gives zeros (the book's convention)."""
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(x - m)
    d = e.sum(axis=-1, keepdims=True)
    return np.where(d > 0, e / np.where(d > 0, d, 1.0), 0.0)


def layernorm_reference(x, gamma, beta, eps: float) -> np.ndarray:
    """torch.nn.functional.layer_norm in float64 on the CPU (numpy if torch is missing)."""
    x64 = np.asarray(x, dtype=np.float64)
    try:
        import torch
        import torch.nn.functional as F

        return F.layer_norm(torch.from_numpy(x64), (x64.shape[-1],),
                            torch.from_numpy(np.asarray(gamma, np.float64)),
                            torch.from_numpy(np.asarray(beta, np.float64)), eps).numpy()
    except ImportError:
        mean = x64.mean(-1, keepdims=True)
        var = ((x64 - mean) ** 2).mean(-1, keepdims=True)
        return (x64 - mean) / np.sqrt(var + eps) * gamma + beta


def rmsnorm_reference(x, gamma, eps: float) -> np.ndarray:
    """RMSNorm over the last dimension: x / sqrt(mean(x^2) + eps) * gamma, float64."""
    x64 = np.asarray(x, dtype=np.float64)
    return x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + eps) * np.asarray(gamma, np.float64)


def conv1d_reference(x, w) -> np.ndarray:
    """'same' 1D cross-correlation with zero padding (K odd), float64."""
    x64 = np.asarray(x, dtype=np.float64)
    w64 = np.asarray(w, dtype=np.float64)
    p = w64.size // 2
    return np.convolve(np.pad(x64, p), w64[::-1], "valid")


def conv2d_reference(x, w) -> np.ndarray:
    """'same' cross-correlation with zero padding, float64 (torch.nn.functional.conv2d)."""
    x64 = np.asarray(x, dtype=np.float64)
    w64 = np.asarray(w, dtype=np.float64)
    K = w64.shape[0]
    p = K // 2
    xp = np.pad(x64, p)
    H, W = x64.shape
    out = np.zeros((H, W))
    for a in range(K):
        for b in range(K):
            out += w64[a, b] * xp[a:a + H, b:b + W]
    return out


def gelu_tanh_reference(z) -> np.ndarray:
    """GELU, tanh approximation (torch approximate='tanh'), float64."""
    z = np.asarray(z, dtype=np.float64)
    return 0.5 * z * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z ** 3)))


def gelu_erf_reference(z) -> np.ndarray:
    """GELU, exact erf form (torch's default), float64."""
    z = np.asarray(z, dtype=np.float64)
    erf = np.vectorize(math.erf)
    return 0.5 * z * (1.0 + erf(z / math.sqrt(2.0)))


def matmul_reference(a, b) -> np.ndarray:
    """a @ b in float64."""
    return np.asarray(a, dtype=np.float64) @ np.asarray(b, dtype=np.float64)
