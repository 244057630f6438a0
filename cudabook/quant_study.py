"""Chapter 10's accuracy study: the tiny GPT with outlier channels, quantized four ways.

    from cudabook import gpt, quant_study as QS
    model, how = gpt.load_tiny()                     # trained on a GPU (cached), else random
    ev_ids, cal = QS.study_tokens()                  # 64 KiB held out, 128 x 256 bytes calibrate
    out, where = QS.with_outliers(model)             # the same function, LayerNorm outliers
    ev = QS.Evaluator(out, ev_ids)                   # the float model's predictions, kept
    m4, info = QS.quantize_weights(out, "gptq", cal)        # int4 group 128: rtn | gptq | awq
    ev(m4)                                           # {"nats", "ppl", "agree", "kl", "tokens"}
    m8 = QS.w8a8_model(out, per="token", smooth=0.5, calib=cal)   # W8A8 (+ SmoothQuant)
    lg = QS.decode_logits(out, ids, QS.KV_SCHEMES["int8"])       # decode with an int8 KV cache
    w = QS.to_qweight(*info["weights"]["blocks.0.fc"])      # what the chapter's int4 kernels read

**The int4 format is the chapter's** (``kernels/qgemv_launch.py``'s ``prepare``): symmetric, a
group of ``group`` consecutive weights of a row shares one scale s = max|w| / qmax computed in
float32, q = clamp(rint(w / s), -qmax, qmax) (ties to even, as ``cudabook.quant``), and the scale
is *stored* as fp16: the weight the kernels multiply by is q * fp16(s). RTN, GPTQ and AWQ all
produce (q int8 (N, K), s float16 (N, K / group)) in that format, so ``to_qweight`` hands any of
them to ``qgemv`` unchanged.

**Methods.** RTN: round to nearest, no data. GPTQ (Frantar et al., ICLR 2023): columns rounded in
order, the rounding error of column i spread over the columns not yet rounded through the upper
Cholesky factor of the inverse Hessian H = 2 X^T X / n of calibration inputs, damped by 1% of its
mean diagonal, with lazy updates in blocks of 128 columns; a group's scale is taken when its first
column is reached, from the columns' values at that moment (no activation reordering). AWQ (Lin et
al., MLSys 2024): input channel j of W multiplied by s_j = mean|X_j|^alpha (normalised), alpha the
best of 0, 0.05, .., 0.95 for the layer's own output error on calibration inputs, 1 / s folded into
the op that produces the layer's input (no clipping search). SmoothQuant (Xiao et al., ICML 2023):
s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) (``cudabook.quant.smooth_scales``), x / s folded into
the LayerNorm before the layer, W s quantized per output channel, activations int8 per token or
per tensor, dynamically (``W8A8Linear``). KV cache: keys and values rounded as they are written,
int8 or int4 with an fp16 scale per token, head and group of the head dimension, or keys with
static per-channel scales from calibration (``KVScheme``).

**Where a scale folds** (``SITE``): qkv's input is ln1's output (the LayerNorm's gain and bias),
proj's is the attention output (the v rows of qkv: attention is linear in V), fc's is ln2's, the
head's is ln_f's. fc2's input is GELU's output, which no weight can absorb: ``ScaledInput``
multiplies it by a vector before fc2 (llm-awq's ScaledActivation), an elementwise op that a kernel
fuses into the GELU. Every fold is exact in real arithmetic: the float model's function does not
change (to rounding), which ``with_outliers`` uses to put outlier channels into a model.

Everything runs in PyTorch on the model's device; the CPU runs it at small sizes (tests). Each
function refuses bad input (a group that does not divide K, a Hessian that is not positive
definite after damping, NaN weights, an unknown method) with a message that says what to change.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np
import torch
from torch import nn

from . import quant as Q

__all__ = ["SITE", "AWQ_ALPHAS", "KV_SCHEMES", "KVScheme", "ScaledInput", "W8A8Linear",
           "Evaluator", "QuantKVCache", "quantize_groups", "dequantize_groups", "rtn", "hessian",
           "gptq", "awq_search", "smooth_scales", "quantize_act", "linear_names", "get_linear",
           "set_linear", "rescale_input", "rescale_keys", "with_outliers", "capture_inputs",
           "capture_absmax", "quantize_weights", "w8a8_model", "compare", "study_tokens",
           "kv_quantize", "key_absmax", "key_scales", "decode_logits", "kv_bytes", "pack_for_qgemv",
           "to_qweight", "channel_spread"]

#: the producer of each linear layer's input, where a per-channel scale folds
SITE = {"qkv": "ln1", "proj": "v", "fc": "ln2", "fc2": "gelu", "head": "ln_f"}
#: llm-awq's grid: alpha = 0, 0.05, .., 0.95 (n_grid = 20)
AWQ_ALPHAS = tuple(i / 20 for i in range(20))
_BLOCK_LINEARS = ("qkv", "proj", "fc", "fc2")
_OUTLIER_SITES = ("ln1", "ln2", "ln_f", "v", "k")


# ================================================================================ checks
def _weight(W: Any, name: str = "W") -> torch.Tensor:
    if not isinstance(W, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(W).__name__}")
    if W.ndim != 2:
        raise ValueError(f"{name} must be 2D (N, K), got shape {tuple(W.shape)}")
    if not W.is_floating_point():
        raise TypeError(f"{name} must be a float tensor, got {W.dtype}")
    if not bool(torch.isfinite(W).all()):
        raise ValueError(f"{name} holds NaN or inf: its scales would too")
    return W


def _bits(bits: Any) -> int:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 2 <= bits <= 8:
        raise ValueError(f"bits must be an int in 2..8 (4: the chapter's W4A16, 8: W8A8), "
                         f"got {bits!r}")
    return int(bits)


def _group(K: int, group: Any, dim: str = "K") -> int:
    if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or group < 1:
        raise TypeError(f"group must be a positive int ({dim} for one scale per row), got "
                        f"{group!r}")
    if K % group:
        raise ValueError(f"group size {group} does not divide {dim} = {K}: each row must split "
                         f"into whole groups (the chapter's kernels use 128; {dim} for one scale "
                         "per row)")
    return int(group)


def _qmax(bits: int) -> int:
    return 2 ** (bits - 1) - 1


# ================================================================================ int4 groups
def _scales(g: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(s32, s16) of groups g (..., G): max|g| / qmax in float32 (what the rounding divides by:
    ``cudabook.quant``'s rule, 1 for an all-zero group), and that scale rounded to fp16 (what the
    chapter's kernels store and multiply by), as float32."""
    amax = g.abs().amax(-1).float()
    s32 = torch.where(amax > 0, amax / _qmax(bits), torch.ones_like(amax))
    s16 = s32.half()
    if not bool(torch.isfinite(s16).all()):
        raise ValueError(f"a group's max|w| / {_qmax(bits)} is above fp16's 65504: the chapter's "
                         "kernels store scales as fp16 (scale the weight down first)")
    return s32, s16.float()


def quantize_groups(W: torch.Tensor, bits: int = 4,
                    group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Round to nearest in the chapter's format: (q int8 (N, K) in -qmax..qmax, s float16
    (N, K // group)). q equals ``cudabook.quant.quantize_reference(W, bits, group)``'s, and s is
    its float32 scale rounded to fp16, as ``qgemv_launch.prepare`` stores it."""
    W = _weight(W)
    bits = _bits(bits)
    N, K = W.shape
    G = _group(K, group)
    g = W.float().reshape(N, K // G, G)
    s32, s16 = _scales(g, bits)
    q = torch.round(g / s32[..., None]).clamp(-_qmax(bits), _qmax(bits))
    return q.to(torch.int8).reshape(N, K), s16.half()


def dequantize_groups(q: torch.Tensor, s: torch.Tensor, group: int = 128) -> torch.Tensor:
    """q * s per group, float32 (N, K): the weight the chapter's kernels multiply by."""
    if q.ndim != 2:
        raise ValueError(f"q must be 2D (N, K), got shape {tuple(q.shape)}")
    N, K = q.shape
    G = _group(K, group)
    if tuple(s.shape) != (N, K // G):
        raise ValueError(f"s has shape {tuple(s.shape)}; q {tuple(q.shape)} in groups of {G} "
                         f"needs ({N}, {K // G})")
    return (q.float().reshape(N, K // G, G) * s.float()[..., None]).reshape(N, K)


def rtn(W: torch.Tensor, bits: int = 4, group: int = 128) -> torch.Tensor:
    """W rounded to nearest in the chapter's format and back: float32 (N, K)."""
    return dequantize_groups(*quantize_groups(W, bits, group), group)


# ================================================================================ GPTQ
def hessian(X: torch.Tensor) -> torch.Tensor:
    """GPTQ's H = 2 X^T X / n of inputs X (n, K), float64 (K, K): for a weight error dW (N, K),
    ||X dW^T||_F^2 = (n / 2) tr(dW H dW^T), the objective GPTQ minimises row by row."""
    X = _weight(X, "X")
    Xd = X.double()
    return 2.0 / X.shape[0] * (Xd.T @ Xd)


def gptq(W: torch.Tensor, H: torch.Tensor, bits: int = 4, group: int = 128,
         damp: float = 0.01, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ (Frantar et al., 2023) in the chapter's int4 group format: (q int8, s float16).

    Columns are rounded left to right. With U the upper Cholesky factor of H^-1 (H damped by
    ``damp`` times its mean diagonal), rounding column i leaves the error e = (w_i - q_i s) / U_ii,
    and the columns to its right take w_j -= e U_ij: inside a block of ``block`` columns at once,
    beyond it once per block (the lazy batch update). A group's scale is set when its first column
    is reached, from the group's values at that moment. Inputs that never fire (H_ii = 0) get
    H_ii = 1 and zero weights, as in the reference code. float64 throughout."""
    W = _weight(W)
    bits = _bits(bits)
    N, K = W.shape
    G = _group(K, group)
    if not isinstance(H, torch.Tensor) or tuple(H.shape) != (K, K):
        raise ValueError(f"H must be a ({K}, {K}) tensor (hessian(X) of the layer's inputs), got "
                         f"{tuple(H.shape) if isinstance(H, torch.Tensor) else type(H).__name__}")
    if not bool(torch.isfinite(H).all()):
        raise ValueError("H holds NaN or inf (were the calibration inputs finite?)")
    if isinstance(damp, bool) or not 0.0 <= float(damp) < 1.0:
        raise ValueError(f"damp is a fraction of H's mean diagonal in [0, 1), got {damp!r}")
    block = max(128, G) if block is None else block
    if isinstance(block, bool) or not isinstance(block, int) or block < 1 or block % G:
        raise ValueError(f"block must be a positive multiple of the group size {G} (a group's "
                         f"scale is taken inside one block), got {block!r}")
    W = W.detach().double().clone()
    H = H.detach().double().clone().to(W.device)
    dead = H.diagonal() == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H.diagonal().add_(float(damp) * H.diagonal().mean())
    L, info = torch.linalg.cholesky_ex(H)
    if int(info):
        raise ValueError("H is not positive definite even after damping: raise damp, or use more "
                         "calibration tokens than input channels")
    U = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)
    qmax = _qmax(bits)
    q = torch.zeros(N, K, dtype=torch.int8, device=W.device)
    s = torch.zeros(N, K // G, dtype=torch.float16, device=W.device)
    for i1 in range(0, K, block):
        i2 = min(i1 + block, K)
        W1, E1, U1 = W[:, i1:i2].clone(), torch.zeros_like(W[:, i1:i2]), U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            c = i1 + i
            if c % G == 0:                                   # the group starts: its scale, now
                s32, s16 = _scales(W1[:, i:i + G], bits)
                s[:, c // G] = s16.half()
            qc = torch.round(W1[:, i].float() / s32).clamp(-qmax, qmax)
            q[:, c] = qc.to(torch.int8)
            e = (W1[:, i] - qc.double() * s16.double()) / U1[i, i]
            W1[:, i:] -= e[:, None] * U1[i, i:][None, :]
            E1[:, i] = e
        W[:, i2:] -= E1 @ U[i1:i2, i2:]                      # the lazy update of later blocks
    return q, s


# ================================================================================ AWQ
def awq_search(W: torch.Tensor, X: torch.Tensor, bits: int = 4, group: int = 128,
               alphas: Iterable[float] = AWQ_ALPHAS) -> tuple[torch.Tensor, float, list[float]]:
    """AWQ's scale search (Lin et al., 2024) for one layer: (s float32 (K,), alpha, errors).

    For each alpha: s = mean|X_j|^alpha (clamped at 1e-4), divided by sqrt(max s * min s); the
    weight is rounded as W s and multiplied by x / s, and the error is the mean square of
    x (Q(W s) / s)^T - x W^T over the calibration inputs X (n, K). The smallest error wins (the
    first on a tie); alpha = 0 is s = 1, plain rounding. The caller folds 1 / s into the op that
    produces x (``rescale_input(model, name, 1 / s)``) and quantizes W s."""
    W, X = _weight(W), _weight(X, "X")
    if X.shape[1] != W.shape[1]:
        raise ValueError(f"X has K = {X.shape[1]} channels, W has K = {W.shape[1]}")
    alphas = [float(a) for a in alphas]
    if not alphas or any(not 0.0 <= a <= 1.0 for a in alphas):
        raise ValueError(f"alphas must be a non-empty list of numbers in [0, 1], got {alphas}")
    Xf, Wf = X.float(), W.float()
    ref = Xf @ Wf.T
    mean = Xf.abs().mean(0)
    best: tuple[float, torch.Tensor, float] = (math.inf, torch.ones_like(mean), 0.0)
    errors = []
    for a in alphas:
        sc = mean.pow(a).clamp(min=1e-4)
        sc = sc / (sc.max() * sc.min()).sqrt()
        Wq = rtn(Wf * sc, bits, group) / sc
        err = float(((Xf @ Wq.T - ref) ** 2).mean())
        errors.append(err)
        if err < best[0]:
            best = (err, sc, a)
    return best[1], best[2], errors


# ================================================================================ W8A8
def smooth_scales(act_absmax: torch.Tensor, W: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """SmoothQuant's s_j = max|X_j|^alpha / max|W_j|^(1 - alpha), float32 (K,) on W's device:
    ``cudabook.quant.smooth_scales`` (float64, s = 1 for a channel that is all zero)."""
    W = _weight(W)
    s = Q.smooth_scales(act_absmax.detach().double().cpu().numpy(),
                        W.detach().double().cpu().numpy(), alpha)
    return torch.from_numpy(s).float().to(W.device)


def quantize_act(x: torch.Tensor, per: str = "token",
                 bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric quantization of activations x (T, K): (q, s) float32, q integer-valued
    in -qmax..qmax, s (T, 1) per token or (1, 1) per tensor. The rounding is
    ``cudabook.quant.quantize_activations``'s (float32 division, ties to even)."""
    bits = _bits(bits)
    if per not in ("token", "tensor"):
        raise ValueError(f"per must be 'token' or 'tensor', got {per!r}")
    x = _weight(x, "x").float()
    amax = x.abs().amax(1, keepdim=True) if per == "token" else x.abs().amax().reshape(1, 1)
    s = torch.where(amax > 0, amax / _qmax(bits), torch.ones_like(amax))
    return torch.round(x / s).clamp(-_qmax(bits), _qmax(bits)), s


class W8A8Linear(nn.Module):
    """y = x W^T as a W8A8 GEMM computes it: W int8 with one float32 scale per output channel,
    x int8 with dynamic scales ``per`` token or per tensor (the whole call's activations), the
    integer products summed exactly (float64) and scaled in the epilogue. Matches
    ``cudabook.quant.w8a8_reference``."""

    def __init__(self, weight: torch.Tensor, per: str = "token", bits: int = 8):
        super().__init__()
        if per not in ("token", "tensor"):
            raise ValueError(f"per must be 'token' or 'tensor', got {per!r}")
        W = _weight(weight.detach(), "weight").float()
        self.per, self.bits = per, _bits(bits)
        amax = W.abs().amax(1)                                # one float32 scale per row
        s32 = torch.where(amax > 0, amax / _qmax(self.bits), torch.ones_like(amax))
        qw = torch.round(W / s32[:, None]).clamp(-_qmax(self.bits), _qmax(self.bits))
        self.register_buffer("qw", qw.double())
        self.register_buffer("sw", s32.double())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        qx, sx = quantize_act(x2, self.per, self.bits)
        y = (qx.double() @ self.qw.T) * sx.double() * self.sw[None, :]
        return y.to(x.dtype).reshape(*x.shape[:-1], self.qw.shape[0])


# ================================================================================ the model
class ScaledInput(nn.Module):
    """``lin(x * scale)``: where fc2's input (GELU's output) gets a per-channel scale, since no
    weight can absorb it (llm-awq's ScaledActivation). A kernel fuses it into the GELU."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.lin = lin
        w = lin.weight
        self.register_buffer("scale", torch.ones(w.shape[1], dtype=w.dtype, device=w.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x * self.scale)


def _cfg(model: Any):
    cfg = getattr(model, "cfg", None)
    if cfg is None or not hasattr(model, "blocks"):
        raise TypeError(f"expected the book's GPT (cudabook.gpt), got {type(model).__name__}")
    return cfg


def linear_names(model: Any) -> list[str]:
    """The 17 (for TINY) linear layers in forward order: each block's qkv, proj, fc, fc2, then
    the head."""
    cfg = _cfg(model)
    return [f"blocks.{b}.{n}" for b in range(cfg.n_layer) for n in _BLOCK_LINEARS] + ["head"]


def _split(model: Any, name: str) -> tuple[Any, str, int | None]:
    cfg = _cfg(model)
    parts = name.split(".")
    if name == "head":
        return model, "head", None
    if (len(parts) != 3 or parts[0] != "blocks" or not parts[1].isdigit()
            or not 0 <= int(parts[1]) < cfg.n_layer or parts[2] not in _BLOCK_LINEARS):
        raise ValueError(f"unknown layer {name!r}: one of {linear_names(model)[:5]} .. 'head'")
    return model.blocks[int(parts[1])], parts[2], int(parts[1])


def get_linear(model: Any, name: str) -> nn.Module:
    """The module that multiplies by layer ``name``'s weight (inside a ``ScaledInput``)."""
    parent, attr, _ = _split(model, name)
    m = getattr(parent, attr)
    return m.lin if isinstance(m, ScaledInput) else m


def set_linear(model: Any, name: str, module: nn.Module) -> None:
    """Replace layer ``name``'s linear module (keeping a ``ScaledInput`` around it)."""
    parent, attr, _ = _split(model, name)
    m = getattr(parent, attr)
    if isinstance(m, ScaledInput):
        m.lin = module
    else:
        setattr(parent, attr, module)


def _float_linear(model: Any, name: str) -> nn.Linear:
    m = get_linear(model, name)
    if type(m) is not nn.Linear:
        raise TypeError(f"{name} is a {type(m).__name__}: fold scales into the float model, before "
                        "quantizing it")
    return m


def _vector(s: Any, K: int, like: torch.Tensor, what: str = "s") -> torch.Tensor:
    if not isinstance(s, torch.Tensor) or tuple(s.shape) != (K,):
        raise ValueError(f"{what} must be a tensor of shape ({K},), got "
                         f"{tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__}")
    if not bool(torch.isfinite(s).all()) or bool((s <= 0).any()):
        raise ValueError(f"{what} must be finite and > 0 (a channel scaled by 0 is lost)")
    return s.to(device=like.device, dtype=like.dtype)


@torch.no_grad()
def rescale_input(model: Any, name: str, s: torch.Tensor) -> None:
    """In place, the function unchanged: input channel j of layer ``name`` is multiplied by s_j
    where it is produced (``SITE``) and column j of the layer's weight is divided by it.
    s > 1 makes channel j larger (``with_outliers``); s = 1 / t applies a smoothing or AWQ scale t
    (x / t, W t)."""
    lin = _float_linear(model, name)
    s = _vector(s, lin.weight.shape[1], lin.weight)
    parent, attr, b = _split(model, name)
    site = SITE[attr]
    if site.startswith("ln"):
        ln = model.ln_f if site == "ln_f" else getattr(parent, site)
        ln.weight.mul_(s)
        if ln.bias is not None:
            ln.bias.mul_(s)
    elif site == "v":                                   # attention output = softmax(.) V
        d = _cfg(model).d
        _float_linear(model, f"blocks.{b}.qkv").weight[2 * d:].mul_(s[:, None])
    else:                                               # GELU's output: a ScaledInput
        if not isinstance(parent.fc2, ScaledInput):
            parent.fc2 = ScaledInput(parent.fc2)
        parent.fc2.scale.mul_(s)
    lin.weight.div_(s[None, :])


@torch.no_grad()
def rescale_keys(model: Any, b: int, s: torch.Tensor) -> None:
    """In place, the function unchanged: block ``b``'s keys multiplied by s and its queries
    divided by it, per rotary pair. s is (n_head, head_dim / 2): entry (h, i) scales dimensions
    i and i + D/2 of head h together, which RoPE (half-split) rotates as one 2D vector, so the
    rotation commutes with the scaling and every q . k is unchanged."""
    cfg = _cfg(model)
    H, D, d = cfg.n_head, cfg.head_dim, cfg.d
    qkv = _float_linear(model, f"blocks.{b}.qkv")
    if not isinstance(s, torch.Tensor) or tuple(s.shape) != (H, D // 2):
        raise ValueError(f"s must have shape (n_head, head_dim / 2) = ({H}, {D // 2})")
    full = _vector(torch.cat([s, s], 1).reshape(d), d, qkv.weight, "s")
    qkv.weight[d:2 * d].mul_(full[:, None])
    qkv.weight[:d].div_(full[:, None])


def with_outliers(model: Any, n: int = 4, gain: float = 50.0, seed: int = 0,
                  sites: Iterable[str] = ("ln1", "ln2", "ln_f")) -> tuple[Any, dict]:
    """A copy of ``model`` that computes the same function (to rounding) but whose activations
    have outlier channels: ``n`` of the d residual channels, the same in every layer, multiplied
    by ``gain`` at each LayerNorm of ``sites`` (its gain and bias) with the next layer's columns
    divided by it; "k": ``n`` rotary pairs of the keys multiplied by ``gain`` in every block, the
    queries divided; "v": proj's input channels, through the v rows of qkv. The channels are
    drawn with ``seed``. Returns (model, {"channels": [...], "key_pairs": [(head, i), ...]}).

    Keep "k" apart from the LayerNorm sites when studying SmoothQuant or AWQ: it scales rows of
    qkv, and both methods take statistics over all of qkv's rows (SmoothQuant's max|W_j|, AWQ's
    output error), so it changes their scales; the LayerNorm sites are divided out exactly."""
    cfg = _cfg(model)
    sites = tuple(sites)
    bad = [x for x in sites if x not in _OUTLIER_SITES]
    if bad:
        raise ValueError(f"unknown sites {bad}: choose from {_OUTLIER_SITES}")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= cfg.d // 2:
        raise ValueError(f"n must be an int in 1..{cfg.d // 2} (a few channels), got {n!r}")
    if isinstance(gain, bool) or not (math.isfinite(float(gain)) and float(gain) > 0):
        raise ValueError(f"gain must be finite and > 0, got {gain!r}")
    g = torch.Generator().manual_seed(seed)
    ch = torch.randperm(cfg.d, generator=g)[:n].sort().values
    pairs = torch.randperm(cfg.d // 2, generator=g)[:n].sort().values
    m = copy.deepcopy(model)
    ref = next(m.parameters())
    s = torch.ones(cfg.d, dtype=ref.dtype)
    s[ch] = float(gain)
    for name in linear_names(m):
        if SITE[name.split(".")[-1]] in sites:             # ln1, ln2, ln_f, v (never fc2)
            rescale_input(m, name, s.to(ref.device))
    if "k" in sites:
        sk = torch.ones(cfg.d // 2, dtype=ref.dtype)
        sk[pairs] = float(gain)
        for b in range(cfg.n_layer):
            rescale_keys(m, b, sk.view(cfg.n_head, cfg.head_dim // 2).to(ref.device))
    half = cfg.head_dim // 2             # report only what was changed
    return m, {"channels": ch.tolist() if set(sites) - {"k"} else [],
               "key_pairs": [(int(p) // half, int(p) % half) for p in pairs] if "k" in sites
               else [], "gain": float(gain), "sites": sites}


# ================================================================================ calibration
def _ids(ids: Any, cfg: Any) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.dtype != torch.long:
        raise ValueError("token ids must be a (sequences, T) LongTensor, got "
                         f"{tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids)}")
    if not 1 <= ids.shape[1] <= cfg.ctx or ids.shape[0] == 0:
        raise ValueError(f"ids of shape {tuple(ids.shape)}: need >= 1 sequence of 1..{cfg.ctx} "
                         "tokens (the model's context)")
    return ids


@torch.no_grad()
def _run_hooked(model: Any, ids: torch.Tensor, names: list[str], fn: Callable,
                batch: int) -> None:
    ids = _ids(ids, _cfg(model))
    dev = next(model.parameters()).device
    hooks = [get_linear(model, n).register_forward_pre_hook(
        lambda mod, inp, n=n: fn(n, inp[0].reshape(-1, inp[0].shape[-1]))) for n in names]
    try:
        for i in range(0, ids.shape[0], batch):
            model(ids[i:i + batch].to(dev), check=False)
    finally:
        for h in hooks:
            h.remove()


def capture_inputs(model: Any, ids: torch.Tensor, names: list[str] | None = None,
                   batch: int = 16) -> dict[str, torch.Tensor]:
    """The inputs of layers ``names`` (default all) on token ids (S, T): {name: X (S T, K)}."""
    names = linear_names(model) if names is None else list(names)
    for n in names:
        get_linear(model, n)
    got: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    _run_hooked(model, ids, names, lambda n, x: got[n].append(x.detach().clone()), batch)
    return {n: torch.cat(v) for n, v in got.items()}


def capture_absmax(model: Any, ids: torch.Tensor, names: list[str] | None = None,
                   batch: int = 16) -> dict[str, torch.Tensor]:
    """max |x_j| over the calibration tokens for each input channel of layers ``names``."""
    names = linear_names(model) if names is None else list(names)
    got: dict[str, torch.Tensor] = {}

    def keep(n, x):
        a = x.detach().abs().amax(0)
        got[n] = a if n not in got else torch.maximum(got[n], a)

    _run_hooked(model, ids, names, keep, batch)
    return got


# ================================================================================ whole models
@torch.no_grad()
def quantize_weights(model: Any, method: str, calib: torch.Tensor | None = None, bits: int = 4,
                     group: int = 128, damp: float = 0.01,
                     alphas: Iterable[float] = AWQ_ALPHAS,
                     names: list[str] | None = None) -> tuple[Any, dict]:
    """A copy of ``model`` with the weights of layers ``names`` (default: all 17) quantized in
    the chapter's format by ``method``: "rtn", "gptq" (calibrated block by block: each block's
    four layers see inputs from the blocks before it already quantized, as the reference code
    does) or "awq" (scales searched on the float model's inputs, folded, then rounded to nearest).
    The weights stay nn.Linear holding q * s (fake quantization). Returns (model, info) with
    info["weights"][name] = (q, s) and, for AWQ, info["alpha"][name]."""
    if method not in ("rtn", "gptq", "awq"):
        raise ValueError(f"method must be 'rtn', 'gptq' or 'awq', got {method!r}")
    if method != "rtn" and calib is None:
        raise ValueError(f"{method} needs calibration token ids (calib), as its paper does")
    m = copy.deepcopy(model)
    names = linear_names(m) if names is None else list(names)
    info: dict[str, Any] = {"method": method, "bits": bits, "group": group, "weights": {},
                            "alpha": {}}

    def put(n: str, H: torch.Tensor | None = None) -> None:
        W = _float_linear(m, n).weight
        q, s = quantize_groups(W, bits, group) if H is None else gptq(W, H, bits, group, damp)
        info["weights"][n] = (q, s)
        W.copy_(dequantize_groups(q, s, group))

    if method == "gptq":                    # block by block, inputs through quantized blocks
        stages: dict[str, list[str]] = {}
        for n in names:
            stages.setdefault(n.rsplit(".", 1)[0], []).append(n)
        for stage in stages.values():
            X = capture_inputs(m, calib, stage)
            for n in stage:
                put(n, hessian(X.pop(n)))
        return m, info
    if method == "awq":                     # every scale from the float model, folded first
        X = capture_inputs(m, calib, names)
        for n in names:
            s, a, _ = awq_search(_float_linear(m, n).weight, X.pop(n), bits, group, alphas)
            rescale_input(m, n, 1.0 / s)                  # x / s at the producer, W s
            info["alpha"][n] = a
    for n in names:
        put(n)
    return m, info


@torch.no_grad()
def w8a8_model(model: Any, per: str = "token", smooth: float | None = None,
               calib: torch.Tensor | None = None, names: list[str] | None = None,
               smooth_sites: Iterable[str] = ("ln1", "ln2", "ln_f")) -> Any:
    """A copy of ``model`` whose layers ``names`` (default all) are W8A8 (``W8A8Linear``: int8
    weights per output channel, int8 activations per token or per tensor). With ``smooth`` =
    alpha, SmoothQuant first: for the layers whose input comes from a site in ``smooth_sites``
    (the LayerNorms, as the SmoothQuant code does), s from max|x_j| on ``calib`` folded in."""
    if per not in ("token", "tensor"):
        raise ValueError(f"per must be 'token' or 'tensor', got {per!r}")
    m = copy.deepcopy(model)
    names = linear_names(m) if names is None else list(names)
    if smooth is not None:
        if calib is None:
            raise ValueError("SmoothQuant needs calibration token ids (calib) for max|x_j|")
        todo = [n for n in names if SITE[n.split(".")[-1]] in tuple(smooth_sites)]
        amax = capture_absmax(m, calib, todo)
        for n in todo:
            rescale_input(m, n, 1.0 / smooth_scales(amax[n], _float_linear(m, n).weight, smooth))
    for n in names:
        set_linear(m, n, W8A8Linear(_float_linear(m, n).weight, per))
    return m


# ================================================================================ measuring
def compare(logits: torch.Tensor, ref_logits: torch.Tensor, targets: torch.Tensor) -> dict:
    """Next-token loss of ``logits`` (..., V) on ``targets`` (...), and how far they are from
    ``ref_logits``: {"nats", "ppl", "agree" (share of positions with the same most likely token),
    "kl" (KL(ref || logits) per position, nats), "tokens"}."""
    if logits.shape != ref_logits.shape or logits.shape[:-1] != targets.shape:
        raise ValueError(f"shapes: logits {tuple(logits.shape)}, ref {tuple(ref_logits.shape)}, "
                         f"targets {tuple(targets.shape)}")
    lp = torch.log_softmax(logits.double(), -1)
    rp = torch.log_softmax(ref_logits.double(), -1)
    nats = float(-lp.gather(-1, targets[..., None].to(lp.device)).mean())
    return {"nats": nats, "ppl": math.exp(nats),
            "agree": float((lp.argmax(-1) == rp.argmax(-1)).double().mean()),
            "kl": float((rp.exp() * (rp - lp)).sum(-1).mean()), "tokens": targets.numel()}


class Evaluator:
    """Held-out windows and a reference model's logits on them, kept. ``ev(model)`` returns
    ``compare``'s dict. The windows are ``gpt.perplexity``'s: non-overlapping, of the model's
    context, n = (len - 1) // ctx * ctx tokens, so the reference's "ppl" is that function's."""

    def __init__(self, reference: Any, tokens: torch.Tensor, batch: int = 16):
        cfg = _cfg(reference)
        if not isinstance(tokens, torch.Tensor) or tokens.ndim != 1:
            raise ValueError("tokens must be a 1D LongTensor of held-out ids")
        n = (len(tokens) - 1) // cfg.ctx * cfg.ctx
        if n == 0:
            raise ValueError(f"need more than {cfg.ctx} tokens, got {len(tokens)}")
        self.x = tokens[:n].view(-1, cfg.ctx)
        self.y = tokens[1:n + 1].view(-1, cfg.ctx)
        self.batch = batch
        self.ref = self.logits(reference)

    @torch.no_grad()
    def logits(self, model: Any) -> torch.Tensor:
        dev = next(model.parameters()).device
        return torch.cat([model(self.x[i:i + self.batch].to(dev), check=False).float()
                          for i in range(0, len(self.x), self.batch)])

    def __call__(self, model: Any) -> dict:
        lg = self.logits(model)
        return compare(lg, self.ref, self.y.to(lg.device))


def study_tokens(n_eval: int = 65536, n_cal: int = 128, ctx: int = 256,
                 max_bytes: int = 8 << 20) -> tuple[torch.Tensor, torch.Tensor]:
    """(eval ids (n_eval,), calibration ids (n_cal, ctx)) from the GPT's held-out text
    (``gpt.heldout``): the first n_eval bytes are the ones the chapter's perplexity table
    measures; calibration takes the n_cal x ctx bytes after them (neither was trained on)."""
    from . import gpt

    for v, nm in ((n_eval, "n_eval"), (n_cal, "n_cal"), (ctx, "ctx")):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{nm} must be a positive int, got {v!r}")
    need = n_eval + n_cal * ctx
    ids = gpt.heldout(need, max_bytes)
    if len(ids) < need:
        raise ValueError(f"the held-out text has {len(ids)} bytes; {n_eval} + {n_cal} x {ctx} "
                         f"= {need} were asked for")
    return ids[:n_eval].clone(), ids[n_eval:].reshape(n_cal, ctx).clone()


def channel_spread(X: torch.Tensor) -> float:
    """The largest channel's max|X_j| over the median channel's, from inputs X (n, K) or from
    the per-channel maxima (K,) (``capture_absmax``): 1 to 2 without outliers."""
    if isinstance(X, torch.Tensor) and X.ndim == 1:
        X = X[None]
    a = _weight(X, "X").abs().amax(0).float()
    return float(a.max() / a.median().clamp(min=1e-30))


# ================================================================================ KV cache
@dataclass(frozen=True)
class KVScheme:
    """How the KV cache stores keys and values. ``bits`` None: float32 as computed; 16: fp16;
    8 or 4: symmetric integers with an fp16 scale per token, head and ``group`` consecutive
    values of the head dimension (None: the whole head). ``keys="channel"``: the keys use one
    static scale per (layer, head, dimension) from calibration instead (``key_scales``)."""

    name: str
    bits: int | None = None
    group: int | None = None
    keys: str = "token"

    def check(self, head_dim: int) -> None:
        if self.bits not in (None, 16) and self.bits not in range(2, 9):
            raise ValueError(f"{self.name}: bits must be None, 16 or 2..8, got {self.bits!r}")
        if self.keys not in ("token", "channel"):
            raise ValueError(f"{self.name}: keys must be 'token' or 'channel', got {self.keys!r}")
        if self.keys == "channel" and self.bits in (None, 16):
            raise ValueError(f"{self.name}: per-channel keys need integer bits")
        if self.group is not None:
            _group(head_dim, self.group, "head_dim")


KV_SCHEMES = {
    "fp32": KVScheme("fp32 (as computed)"),
    "fp16": KVScheme("fp16", 16),
    "int8": KVScheme("int8, per token and head", 8),
    "int4 g64": KVScheme("int4, group 64", 4, 64),
    "int8 K/channel": KVScheme("int8, keys per channel", 8, keys="channel"),
    "int4 K/channel": KVScheme("int4, keys per channel, values group 64", 4, 64, "channel"),
}


def kv_quantize(x: torch.Tensor, bits: int | None, group: int | None = None) -> torch.Tensor:
    """x (..., D) rounded as a KV cache stores it and read back (x's dtype): None: unchanged;
    16: through fp16; 2..8: symmetric, one fp16 scale per ``group`` values of the last dimension
    (the chapter's weight rule applied along the head dimension)."""
    if bits is None:
        return x
    if bits == 16:
        return x.half().to(x.dtype)
    bits = _bits(bits)
    D = x.shape[-1]
    G = _group(D, D if group is None else group, "head_dim")
    g = x.float().reshape(*x.shape[:-1], D // G, G)
    s32, s16 = _scales(g, bits)
    q = torch.round(g / s32[..., None]).clamp(-_qmax(bits), _qmax(bits))
    return (q * s16[..., None]).reshape(x.shape).to(x.dtype)


class _Store:
    """What QuantKVCache.k and .v are: a tensor written through ``fn(layer, value)``."""

    def __init__(self, t: torch.Tensor, fn: Callable):
        self.t, self.fn = t, fn

    def __setitem__(self, idx, value):
        self.t[idx] = self.fn(idx[0], value)

    def __getitem__(self, idx):
        return self.t[idx]


class QuantKVCache:
    """``gpt.KVCache`` whose keys and values are rounded by ``scheme`` as the model writes them
    (the prefill's and each decode step's), so attention reads what a quantized cache holds.
    ``key_scales`` (n_layer, n_head, head_dim): the static scales of ``keys="channel"``.
    ``record=True`` keeps max|k| per (layer, head, dimension) in ``self.kmax`` instead."""

    def __init__(self, cfg: Any, batch: int, scheme: KVScheme, device=None,
                 key_scales: torch.Tensor | None = None, record: bool = False):
        from . import gpt

        scheme.check(cfg.head_dim)
        base = gpt.KVCache(cfg, batch, device)
        self.length = base.length
        self.kmax = torch.zeros(cfg.n_layer, cfg.n_head, cfg.head_dim, device=base.k.device)
        if scheme.keys == "channel":
            want = (cfg.n_layer, cfg.n_head, cfg.head_dim)
            if key_scales is None or tuple(key_scales.shape) != want:
                raise ValueError(f"{scheme.name}: keys per channel need key_scales of shape "
                                 f"{want} (QS.key_scales(model, calib, bits))")
            ks = key_scales.to(device=base.k.device, dtype=torch.float32)
            qm = _qmax(scheme.bits)

            def kfn(layer, k):                               # k (B, H, T, D)
                s = ks[layer][None, :, None, :]
                return (torch.round(k.float() / s).clamp(-qm, qm) * s).to(k.dtype)
        elif record:
            def kfn(layer, k):
                self.kmax[layer] = torch.maximum(self.kmax[layer], k.abs().amax((0, 2)))
                return k
        else:
            def kfn(layer, k):
                return kv_quantize(k, scheme.bits, scheme.group)
        self.k = _Store(base.k, kfn)
        self.v = _Store(base.v, lambda layer, v: kv_quantize(v, scheme.bits, scheme.group))


@torch.no_grad()
def key_absmax(model: Any, ids: torch.Tensor, batch: int = 16) -> torch.Tensor:
    """max |k| over every token of calibration ids (S, T), per (layer, head, dimension) of the
    keys as the cache stores them (after RoPE): float32 (n_layer, n_head, head_dim)."""
    cfg = _cfg(model)
    ids = _ids(ids, cfg)
    dev = next(model.parameters()).device
    cache = QuantKVCache(cfg, batch, KV_SCHEMES["fp32"], dev, record=True)
    for i in range(0, ids.shape[0], batch):
        model(ids[i:i + batch].to(dev), cache, 0, check=False)
    return cache.kmax


def key_scales(model: Any, ids: torch.Tensor, bits: int = 8, batch: int = 16) -> torch.Tensor:
    """Static per-channel key scales from calibration ids (S, T): ``key_absmax`` / qmax, rounded
    to fp16 (float32 (n_layer, H, D); 1 where a channel is all zero). Keys beyond the calibrated
    range clamp at run time."""
    bits = _bits(bits)
    k = key_absmax(model, ids, batch)
    return torch.where(k > 0, k / _qmax(bits), torch.ones_like(k)).half().float()


@torch.no_grad()
def decode_logits(model: Any, ids: torch.Tensor, scheme: KVScheme,
                  key_scales: torch.Tensor | None = None, batch: int = 64) -> torch.Tensor:
    """Teacher-forced decode of ids (S, T) one token a step from position 0, the KV cache stored
    by ``scheme``: logits (S, T, V) float32, those of step t predicting token t + 1."""
    cfg = _cfg(model)
    ids = _ids(ids, cfg)
    dev = next(model.parameters()).device
    out = []
    for i in range(0, ids.shape[0], batch):
        x = ids[i:i + batch].to(dev)
        cache = QuantKVCache(cfg, x.shape[0], scheme, dev, key_scales)
        out.append(torch.cat([model(x[:, t:t + 1], cache, t, check=False).float()
                              for t in range(x.shape[1])], 1))
    return torch.cat(out)


def kv_bytes(cfg: Any, scheme: KVScheme, tokens: int = 1, batch: int = 1,
             static: bool = True) -> int:
    """Bytes of the KV cache of ``tokens`` positions of ``batch`` sequences for configuration
    ``cfg``: n_layer x (keys + values) x d values each, plus their fp16 scales (per token, head
    and group). The static per-channel key scales of ``keys="channel"`` (n_head x head_dim fp16
    per layer) are counted once, or not at all with ``static=False`` (bytes per token)."""
    scheme.check(cfg.head_dim)
    for v, nm in ((tokens, "tokens"), (batch, "batch")):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{nm} must be an int >= 0, got {v!r}")
    d, L = cfg.d, cfg.n_layer
    n = tokens * batch
    if scheme.bits is None:
        return 2 * L * n * d * 4
    if scheme.bits == 16:
        return 2 * L * n * d * 2
    per = d * scheme.bits / 8                              # values of one token, one tensor
    scales = 2 * d // (scheme.group or cfg.head_dim)       # their fp16 scales
    if scheme.keys == "channel":
        keys = per * n + (2 * cfg.n_head * cfg.head_dim if static else 0)
    else:
        keys = (per + scales) * n
    return int(math.ceil(L * (keys + (per + scales) * n)))


# ================================================================================ the kernels
def pack_for_qgemv(q: torch.Tensor, s: torch.Tensor,
                   group: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """(packed uint8 (N, K / 2), scales float16 (N, K / group)) as ``qgemv_launch.QWeight``
    holds an int4 weight: element 2i in the low nibble of byte i (``quant.pack_int4_reference``)."""
    if q.ndim != 2 or q.dtype != torch.int8:
        raise ValueError(f"q must be int8 (N, K), got {q.dtype} {tuple(q.shape)}")
    N, K = q.shape
    if K % 2:
        raise ValueError(f"K = {K} is odd: packed int4 holds two values per byte")
    G = _group(K, group)
    if tuple(s.shape) != (N, K // G):
        raise ValueError(f"s has shape {tuple(s.shape)}, expected ({N}, {K // G})")
    packed = Q.pack_int4_reference(q.cpu().numpy()).reshape(N, K // 2)
    return packed, s.detach().cpu().numpy().astype(np.float16)


def to_qweight(q: torch.Tensor, s: torch.Tensor, group: int = 128):
    """The chapter's W4A16 weight (``kernels/qgemv_launch.py``'s QWeight) holding these int4
    values and fp16 scales, on the GPU: ``qg.qgemv(x, to_qweight(q, s))`` runs the layer that
    RTN, GPTQ or AWQ produced with the chapter's kernels. Needs CuPy and a GPU."""
    import cupy as cp

    import cudabook as cb

    packed, scales = pack_for_qgemv(q, s, group)
    qg = cb.load_launch("qgemv")
    N, K = q.shape
    return qg.QWeight(cp.asarray(packed), cp.asarray(scales), 4, int(group), int(N), int(K))
