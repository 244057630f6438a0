"""The GPT of Chapter 7: configurations, corpus, the PyTorch reference model and its weights.

    from cudabook import gpt
    model, how = gpt.load_tiny()               # trained here (about a minute on an H100), cached
    ids = gpt.encode("def main():")            # bytes -> token ids (vocabulary of 256 bytes)
    logits = model(ids[None].cuda())           # (1, T, 256) float32
    gpt.decode(model.generate(ids, 64))        # greedy, with the KV cache, in PyTorch
    gpt.perplexity(model, gpt.heldout(8192))   # bits per byte etc. on text the model never saw
    big = gpt.build(gpt.GPT2_SMALL, device="cuda", dtype=torch.float16)   # random weights

The model is a pre-norm decoder: token embedding, ``n_layer`` blocks of
``x += attn(LayerNorm(x)); x += mlp(LayerNorm(x))``, a final LayerNorm and an untied LM head. No
Linear layer has a bias (every projection is one matmul, C = A @ W^T with W in nn.Linear's (out,
in) layout). Attention is multi-head, causal, with rotary positions (RoPE) in the **half-split**
convention: for head dimension D the pairs rotated together are (i, i + D/2), i < D/2, by the angle
pos * base^(-2i/D) (GPT-NeoX and Llama; not GPT-J's interleaved (2i, 2i+1)). The MLP is
Linear(d, 4d), GELU (tanh approximation), Linear(4d, d).

Weights: ``load_tiny()`` returns the tiny model trained on bytes of the Python standard library's
own source files (every machine has them: no download); the weights are cached in
``~/.cache/cudabook`` (or ``$CUDABOOK_CACHE``). Without a GPU (or with ``train=False``) and no
cache, it says so and returns deterministic random weights. ``GPT2_SMALL`` has GPT-2-small's shapes
(d = 768, 12 layers, 12 heads, vocabulary 50257) for timing only: random weights.

Public API (stable; Chapter 10 uses it): ``GPTConfig``, ``TINY``, ``GPT2_SMALL``, ``GPT``,
``KVCache``, ``build``, ``load_tiny``, ``train``, ``corpus``, ``heldout``, ``encode``, ``decode``,
``perplexity``, ``cache_path``.
"""

from __future__ import annotations

import hashlib
import math
import os
import pathlib
import sysconfig
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

__all__ = ["GPTConfig", "TINY", "GPT2_SMALL", "GPT", "KVCache", "build", "load_tiny", "train",
           "corpus", "heldout", "encode", "decode", "perplexity", "cache_path", "rope_tables"]


@dataclass(frozen=True)
class GPTConfig:
    """Shapes of the decoder. ``ctx`` is the longest sequence (the KV cache's length)."""

    vocab: int = 256
    d: int = 256
    n_layer: int = 4
    n_head: int = 4
    ctx: int = 256
    rope_base: float = 10000.0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.d // self.n_head

    def params(self) -> int:
        """Number of weights (embedding and LM head included)."""
        d, L = self.d, self.n_layer
        return 2 * self.vocab * d + L * (12 * d * d + 4 * d) + 2 * d


#: the model trained in the book: bytes in, 4 layers of width 256, 4 heads of 64
TINY = GPTConfig()
#: GPT-2-small's shapes (124M-parameter class), for timing with random weights
GPT2_SMALL = GPTConfig(vocab=50257, d=768, n_layer=12, n_head=12, ctx=1024)


def _torch():
    import torch

    return torch


# ================================================================================ the corpus
_CORPUS: dict[int, bytes] = {}


def corpus(max_bytes: int = 8 << 20) -> bytes:
    """Up to ``max_bytes`` of the standard library's ``*.py`` files (site-packages excluded),
    concatenated in sorted path order, each preceded by a line ``# file: <relative path>``.
    The same Python version gives the same bytes on every machine."""
    if max_bytes in _CORPUS:
        return _CORPUS[max_bytes]
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    parts, n = [], 0
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        if rel.startswith(("site-packages", "dist-packages")) or "/test" in "/" + rel:
            continue
        try:
            b = f"# file: {rel}\n".encode() + f.read_bytes() + b"\n"
        except OSError:
            continue
        parts.append(b)
        n += len(b)
        if n >= max_bytes:
            break
    data = b"".join(parts)[:max_bytes]
    if len(data) < 1 << 16:
        raise RuntimeError(f"the standard library at {root} gave only {len(data)} bytes of *.py")
    _CORPUS[max_bytes] = data
    return data


def _split(data: bytes) -> tuple[bytes, bytes]:
    """The last 5% (cut at a line start) is held out: training never sees it."""
    cut = data.rfind(b"\n", 0, int(0.95 * len(data))) + 1
    return data[:cut], data[cut:]


def heldout(n: int = 8192, max_bytes: int = 8 << 20):
    """The first ``n`` bytes of the held-out text as a LongTensor of token ids (CPU)."""
    torch = _torch()
    h = _split(corpus(max_bytes))[1][:n]
    return torch.frombuffer(bytearray(h), dtype=torch.uint8).long()


def encode(text: str | bytes):
    """Token ids of ``text``: its UTF-8 bytes (a LongTensor on the CPU)."""
    torch = _torch()
    b = text.encode() if isinstance(text, str) else bytes(text)
    return torch.tensor(list(b), dtype=torch.long)


def decode(ids: Any) -> str:
    """Text of token ids (bytes that are not valid UTF-8 become U+FFFD)."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


# ================================================================================ the model
def rope_tables(cfg: GPTConfig, n: int, device=None):
    """(cos, sin) of shape (n, head_dim/2), float32: angle[p, i] = p * base^(-2i/D)."""
    torch = _torch()
    D = cfg.head_dim
    inv = cfg.rope_base ** (-torch.arange(0, D // 2, dtype=torch.float64) * 2 / D)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]
    return ang.cos().float().to(device), ang.sin().float().to(device)


def _rope(x, cos, sin):
    """Half-split rotary embedding of x (B, H, T, D) by cos, sin (T, D/2)."""
    torch = _torch()
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h].float(), x[..., h:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


class KVCache:
    """Preallocated keys and values: k, v of shape (n_layer, B, n_head, ctx, head_dim)."""

    def __init__(self, cfg: GPTConfig, batch: int, device=None, dtype=None,
                 length: int | None = None):
        torch = _torch()
        shape = (cfg.n_layer, batch, cfg.n_head, length or cfg.ctx, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype or torch.float32)
        self.v = torch.zeros_like(self.k)
        self.length = shape[3]


def _module_classes():
    torch = _torch()
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self, cfg: GPTConfig):
            super().__init__()
            d = cfg.d
            self.cfg = cfg
            self.ln1 = nn.LayerNorm(d, eps=cfg.eps)
            self.qkv = nn.Linear(d, 3 * d, bias=False)
            self.proj = nn.Linear(d, d, bias=False)
            self.ln2 = nn.LayerNorm(d, eps=cfg.eps)
            self.fc = nn.Linear(d, 4 * d, bias=False)
            self.fc2 = nn.Linear(4 * d, d, bias=False)

        def forward(self, x, cos, sin, cache=None, layer=0, pos=0):
            B, T, d = x.shape
            H, D = self.cfg.n_head, self.cfg.head_dim
            q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, H, D).permute(2, 0, 3, 1, 4)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            if cache is None:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:               # write the new keys/values at pos.., attend over 0..pos+T-1
                cache.k[layer, :B, :, pos:pos + T] = k
                cache.v[layer, :B, :, pos:pos + T] = v
                K, V = cache.k[layer, :B, :, :pos + T], cache.v[layer, :B, :, :pos + T]
                if T == 1:
                    o = F.scaled_dot_product_attention(q, K, V)
                else:
                    mask = torch.ones(T, pos + T, dtype=torch.bool, device=x.device).tril(pos)
                    o = F.scaled_dot_product_attention(q, K, V, attn_mask=mask)
            x = x + self.proj(o.transpose(1, 2).reshape(B, T, d))
            return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        """The decoder. ``forward(idx)`` -> logits (B, T, vocab) in float32; with ``cache`` and
        ``pos`` it appends T tokens at positions pos.. to the cache (prefill or decode).
        ``check=False`` skips the vocabulary check of the ids (it reads them back to the host:
        a synchronisation that a timed decode loop must not pay)."""

        def __init__(self, cfg: GPTConfig):
            super().__init__()
            self.cfg = cfg
            self.wte = nn.Embedding(cfg.vocab, cfg.d)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
            self.ln_f = nn.LayerNorm(cfg.d, eps=cfg.eps)
            self.head = nn.Linear(cfg.d, cfg.vocab, bias=False)
            cos, sin = rope_tables(cfg, cfg.ctx)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)

        def forward(self, idx, cache: KVCache | None = None, pos: int = 0, check: bool = True):
            _check_ids(idx, self.cfg, pos, cache, check)
            T = idx.shape[1]
            cos, sin = self.cos[pos:pos + T], self.sin[pos:pos + T]
            x = self.wte(idx)
            for i, b in enumerate(self.blocks):
                x = b(x, cos, sin, cache, i, pos)
            return self.head(self.ln_f(x)).float()

        @torch.no_grad()
        def generate(self, prompt, n: int, return_logits: bool = False):
            """Greedy continuation of ``prompt`` (1D ids) by ``n`` tokens with a KV cache, in
            PyTorch (the reference for the book's kernels). Returns the new ids (and the logits
            of every step, (n, vocab) float32, when ``return_logits``)."""
            dev = next(self.parameters()).device
            ids = prompt.reshape(1, -1).to(dev)
            if ids.shape[1] + n > self.cfg.ctx:
                raise ValueError(f"prompt of {ids.shape[1]} tokens + {n} new ones is longer than "
                                 f"the cache ({self.cfg.ctx} positions)")
            cache = KVCache(self.cfg, 1, dev, next(self.parameters()).dtype)
            logits = self(ids, cache, 0)[:, -1]
            out, steps = [], []
            pos = ids.shape[1]
            for _ in range(n):
                steps.append(logits[0])
                t = logits.argmax(-1, keepdim=True)
                out.append(int(t))
                if len(out) == n:
                    break
                logits = self(t, cache, pos, check=False)[:, -1]
                pos += 1
            new = torch.tensor(out, dtype=torch.long)
            return (new, torch.stack(steps)) if return_logits else new

    return GPT


def _check_ids(idx, cfg: GPTConfig, pos: int = 0, cache=None, values: bool = True) -> None:
    """Clear errors for the bad inputs of a forward: empty, out of the vocabulary, too long."""
    if idx.ndim != 2:
        raise ValueError(f"token ids must be (batch, T), got shape {tuple(idx.shape)}")
    if idx.shape[1] == 0:
        raise ValueError("empty prompt: at least one token is needed to predict the next")
    if values:
        lo, hi = (int(v) for v in idx.aminmax())
        if lo < 0 or hi >= cfg.vocab:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {cfg.vocab})")
    n = cache.length if cache is not None else cfg.ctx
    if pos + idx.shape[1] > n:
        raise ValueError(f"positions {pos}..{pos + idx.shape[1] - 1} do not fit the cache of "
                         f"{n} positions (prompt longer than the cache?)")


_GPT_CLASS = None


def GPT(cfg: GPTConfig = TINY):  # noqa: N802 - a class, made on first use (torch imported late)
    """A new (untrained, PyTorch-initialised) model of configuration ``cfg``."""
    global _GPT_CLASS
    if _GPT_CLASS is None:
        _GPT_CLASS = _module_classes()
    return _GPT_CLASS(cfg)


def build(cfg: GPTConfig = TINY, seed: int = 0, device=None, dtype=None):
    """``GPT(cfg)`` with deterministic random weights (the same on every machine for a seed):
    N(0, 0.02) matrices, output projections scaled by 1/sqrt(2 n_layer), LayerNorms (1, 0)."""
    torch = _torch()
    m = GPT(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                out = name.endswith(("proj.weight", "fc2.weight"))
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if out else 0.02
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return m.to(device=device, dtype=dtype).eval()


# ================================================================================ training
def cache_path(cfg: GPTConfig = TINY, tag: str = "") -> pathlib.Path:
    """Where trained weights of ``cfg`` are cached (``$CUDABOOK_CACHE`` or ~/.cache/cudabook)."""
    home = pathlib.Path.home() / ".cache" / "cudabook"
    root = pathlib.Path(os.environ.get("CUDABOOK_CACHE", home))
    key = hashlib.sha1(repr(sorted(asdict(cfg).items())).encode() + tag.encode()).hexdigest()[:10]
    return root / f"gpt-{cfg.d}x{cfg.n_layer}-{key}.pt"


def train(cfg: GPTConfig = TINY, seconds: float = 60.0, steps: int = 3000, batch: int = 64,
          lr: float = 2e-3, seed: int = 0, device: str = "cuda", log: Callable | None = print):
    """Train ``cfg`` on the corpus (AdamW, bf16 autocast, warm-up then cosine decay) for ``steps``
    steps or ``seconds``, whichever ends first. Returns (model in float32, eval mode, dict of
    losses). Training on a GPU is not bitwise deterministic: two runs give close, not equal,
    weights."""
    torch = _torch()
    data = torch.frombuffer(bytearray(_split(corpus())[0]), dtype=torch.uint8).to(device).long()
    m = build(cfg, seed, device)
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator(device=device).manual_seed(seed)
    T, hist, t0, step = cfg.ctx, [], time.perf_counter(), 0
    for step in range(steps):
        el = time.perf_counter() - t0
        frac = max(step / steps, el / seconds)
        if frac >= 1:
            break
        for pg in opt.param_groups:
            pg["lr"] = lr * min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * frac))
        i = torch.randint(0, len(data) - T - 1, (batch,), device=device, generator=g)
        xy = data[i[:, None] + torch.arange(T + 1, device=device)]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=str(device).startswith("cuda")):
            logits = m(xy[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab),
                                                 xy[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        if step % 100 == 0:
            hist.append((step, float(loss.detach())))
    m.eval()
    info = {"steps": step, "seconds": time.perf_counter() - t0, "loss": hist,
            "tokens": step * batch * T}
    if log:
        log(f"trained {step} steps ({info['tokens'] / 1e6:.0f}M bytes) in {info['seconds']:.0f} s; "
            f"last training loss {hist[-1][1]:.3f} nats/byte" if hist else "no step ran")
    return m, info


def load_tiny(device=None, train_if_missing: bool = True, seconds: float = 60.0,
              verbose: bool = True):
    """The tiny model and where its weights came from: ("cache" | "trained" | "random").

    Cached weights are used when present; else, on a CUDA GPU, the model is trained (``seconds``)
    and cached; else (no GPU, or ``train_if_missing=False``) the weights are ``build(TINY)``'s
    deterministic random ones, and a message says so."""
    torch = _torch()
    say = print if verbose else (lambda *a: None)
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    path = cache_path(TINY)
    if path.exists():
        m = GPT(TINY)
        m.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        say(f"tiny GPT: trained weights from the cache ({path.name})")
        return m.to(dev).eval(), "cache"
    if train_if_missing and torch.cuda.is_available() and str(dev).startswith("cuda"):
        m, _ = train(TINY, seconds=seconds, device=dev, log=say)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(m.state_dict(), path)
        except OSError as e:
            say(f"(weights not cached: {e})")
        return m, "trained"
    say("tiny GPT: no GPU to train on and no cached weights, so the weights are deterministic "
        "random ones: the generated text is noise, but every comparison with PyTorch still holds")
    return build(TINY, 0, dev), "random"


# ================================================================================ evaluation
def perplexity(model: Any, tokens, ctx: int | None = None, batch: int = 16) -> dict:
    """Cross-entropy of next-byte prediction on ``tokens`` (1D ids), in non-overlapping windows
    of ``ctx`` (the model's context by default). ``model`` is a GPT or any callable mapping ids
    (B, T) to logits (B, T, vocab). Returns {"nats", "bits_per_token", "perplexity", "tokens"}."""
    torch = _torch()
    cfg = getattr(model, "cfg", None)
    ctx = ctx or (cfg.ctx if cfg else 256)
    dev = next(model.parameters()).device if hasattr(model, "parameters") else (
        "cuda" if torch.cuda.is_available() else "cpu")
    n = (len(tokens) - 1) // ctx * ctx
    if n == 0:
        raise ValueError(f"need more than {ctx} tokens, got {len(tokens)}")
    x = tokens[:n].view(-1, ctx).to(dev)
    y = tokens[1:n + 1].view(-1, ctx).to(dev)
    tot = 0.0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            lg = model(x[i:i + batch]).float()
            tot += float(torch.nn.functional.cross_entropy(
                lg.reshape(-1, lg.shape[-1]), y[i:i + batch].reshape(-1), reduction="sum"))
    nats = tot / n
    return {"nats": nats, "bits_per_token": nats / math.log(2), "perplexity": math.exp(nats),
            "tokens": n}
