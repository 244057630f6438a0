"""The GPT of ``cudabook.gpt`` run on the book's kernels: prefill, a KV-cache decode step, a graph.

    from cudabook import gpt, decoder
    model, _ = gpt.load_tiny()
    run = decoder.KernelGPT(model, batch=1)            # weights copied to fp16 CuPy arrays
    new, logits = run.generate(gpt.encode("def "), 64)  # greedy: prefill, then 63 decode steps
    g = run.capture()                                   # the decode step as a CUDA graph
    g(); run.last_logits()                               # one more token

Every op is a kernel of ``kernels/``: embedding_v1, add_layernorm_v1 (residual.cu), the matmuls
(chapter 8's hgemm for prefill; for decode ``kernels/gemv_launch.py`` when present, else hgemm),
rope_qkv_v1 (rope.cu), chapter 9's flash attention (attention_v3) for prefill,
decode_attention_v1 over the cache (kvcache.cu), gelu_half_v1, sample_topk_v1 and advance_v1.
The residual stream is fp32, everything the matmuls read and write is fp16 (fp32 accumulation).

A decode step reads its position and its input token from the GPU (``pos``, ``tok``) and writes
the next token and position back, so one captured graph replays step after step with no host
work. ``fuse_norm=False`` and ``fuse_rope=False`` swap the fused kernels for their pieces
(residual_add_v1 + chapter 3's fp32 layernorm_v3 + to_half_v1; rope_v1 twice + kv_append_v1), to
measure what fusion saves.

The baseline a decoder is compared with is ``StaticCacheDecoder``: the same model's step in
PyTorch the way fast PyTorch decoders run it (a static KV cache, the position on the GPU), so that
it captures in one CUDA graph, after ``torch.compile`` or without it. ``compare_static`` checks it
against the model's own forward; ``step_bytes`` counts what a step must read (the memory bound).

Timing a captured step: ``KernelGPT.step_us``, ``StaticCacheDecoder.step_us`` (and the
megakernel's ``MegaStep.step_us``, kernels/decode_mega_launch.py) all go through ``timed_step``:
the step's graph replayed back to back from one position, its greedy token checked against its
logits before and after timing.
"""

from __future__ import annotations

from typing import Any

from . import env
from .compile import KERNELS_DIR, load_launch

__all__ = ["KernelGPT", "decode_gemm_default", "weight_bytes", "cache_bytes", "per_step_us",
           "timed_step", "StaticCacheDecoder", "compare_static", "check_next_token",
           "step_bytes"]


def per_step_us(step: Any, n: int = 64, warmup: int = 2) -> float:
    """Microseconds per call of ``step()`` over ``n`` calls issued back to back, with one device
    synchronisation at the end (as a generation loop runs: nothing waits between tokens)."""
    import time

    import cupy as cp

    sync = cp.cuda.Device().synchronize
    for _ in range(warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    sync()
    return 1e6 * (time.perf_counter() - t0) / n


def timed_step(step: Any, reset: Any, check: Any, n: int = 100) -> float:
    """Microseconds per call of a decode step ``step`` (a captured graph's replay) over ``n``
    calls back to back (``per_step_us``, after its 2 warm-up calls), from the state ``reset()``
    restores (the position and the input token: every run decodes the same positions).
    Validated before and after: one call, then ``check(when)`` ("before timing", "after
    timing"), which raises (``cudabook.CheckError``) on a wrong step; a step that fails either
    check gets no time. The state is reset again on return. The cache must hold ``n + 3`` more
    positions."""
    reset()
    step()
    check("before timing")
    reset()
    us = per_step_us(step, n=n)
    reset()
    step()
    check("after timing")
    reset()
    return us


def decode_gemm_default() -> str:
    """'gemv' when kernels/gemv_launch.py (Chapter 10) is present, else hgemm's 'v1'."""
    return "gemv" if (KERNELS_DIR / "gemv_launch.py").is_file() else "v1"


def weight_bytes(cfg) -> int:
    """fp16 bytes of the matrices one decode step reads (every layer's four, and the LM head)."""
    return 2 * (cfg.n_layer * 12 * cfg.d * cfg.d + cfg.vocab * cfg.d)


def cache_bytes(cfg, n: int, batch: int = 1) -> int:
    """fp16 bytes of keys and values one decode step reads at n cached positions."""
    return 2 * 2 * cfg.n_layer * batch * n * cfg.d


class KernelGPT:
    """A ``cudabook.gpt`` model's weights on the GPU and the buffers of batch ``batch``."""

    def __init__(self, model: Any, batch: int = 1, length: int | None = None,
                 decode_gemm: str | None = None, prefill_gemm: str = "v9",
                 fuse_norm: bool = True, fuse_rope: bool = True,
                 attention: str = "decode_attention_v2", share: KernelGPT | None = None):
        if not env.HAS_GPU:
            raise RuntimeError("KernelGPT runs CUDA C++ kernels: it needs a CUDA GPU")
        import cupy as cp

        cfg = self.cfg = model.cfg
        self.B, self.L = int(batch), int(length or cfg.ctx)
        if self.B < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if share is not None:                          # the same weights, other buffers
            self.wte, self.head, self.lnf, self.layers = (share.wte, share.head, share.lnf,
                                                          share.layers)
        else:
            self._copy_weights(model.state_dict(), cfg)
        self.k = {n: load_launch(n) for n in ("embedding", "residual", "rope", "kvcache",
                                              "gelu_half", "sampling", "hgemm", "attention",
                                              "norm")}
        self.decode_gemm = decode_gemm or decode_gemm_default()
        self.prefill_gemm = prefill_gemm
        self.gemv = load_launch("gemv") if self.decode_gemm == "gemv" else None
        self.fuse_norm, self.fuse_rope, self.attention = fuse_norm, fuse_rope, attention
        B, L, d, H, D = self.B, self.L, cfg.d, cfg.n_head, cfg.head_dim
        h16t, i32 = cp.float16, cp.int32
        self.kc = cp.zeros((cfg.n_layer, B, H, L, D), h16t)
        self.vc = cp.zeros_like(self.kc)
        self.tok, self.pos = cp.zeros(B, i32), cp.zeros(1, i32)
        self.u = cp.zeros(B, cp.float32)               # greedy by default (temperature 0)
        self.history = cp.zeros((B, L + 1), i32)
        self.x, self.y32 = cp.empty((B, d), cp.float32), cp.empty((B, d), cp.float32)
        self.h, self.a, self.dx = (cp.empty((B, d), h16t) for _ in range(3))
        self.qkv, self.q = cp.empty((B, 3 * d), h16t), cp.empty((B, H, 1, D), h16t)
        self.f, self.logits = cp.empty((B, 4 * d), h16t), cp.empty((B, cfg.vocab), h16t)
        self.temperature, self.top_k, self.top_p = 0.0, 1, 1.0
        self.host_pos = 0                              # the position the GPU's pos holds
        self.graph = None

    def _copy_weights(self, state: dict, cfg) -> None:
        """fp16 matrices, fp32 LayerNorm parameters, as CuPy arrays (copies)."""
        import cupy as cp
        import torch

        sd = {k: v.detach() for k, v in state.items()}

        def dev(t, dt):
            return cp.asarray(t.to("cpu", dt).contiguous().numpy())

        h16, f32 = (lambda t: dev(t, torch.float16)), (lambda t: dev(t, torch.float32))
        self.wte, self.head = h16(sd["wte.weight"]), h16(sd["head.weight"])
        self.lnf = (f32(sd["ln_f.weight"]), f32(sd["ln_f.bias"]))
        self.layers = []
        for i in range(cfg.n_layer):
            p = f"blocks.{i}."
            self.layers.append({
                "ln1": (f32(sd[p + "ln1.weight"]), f32(sd[p + "ln1.bias"])),
                "ln2": (f32(sd[p + "ln2.weight"]), f32(sd[p + "ln2.bias"])),
                **{k: h16(sd[p + k + ".weight"]) for k in ("qkv", "proj", "fc", "fc2")}})

    # ------------------------------------------------------------------ pieces
    def _mm(self, a, W, out, decode: bool):
        if decode and self.gemv is not None:
            return self.gemv.gemv(a, W, out=out)
        return self.k["hgemm"].matmul(a, W, version=self.decode_gemm if decode
                                      else self.prefill_gemm, out=out)

    def _norm(self, x, dx, ln, h):
        if self.fuse_norm:
            return self.k["residual"].add_layernorm(x, dx, ln[0], ln[1], h, self.cfg.eps)
        r = self.k["residual"]
        if dx is not None:
            r.residual_add(x, dx)
        y32 = self.y32 if x.shape[0] == self.B else x.copy()
        self.k["norm"].layernorm(x, ln[0], ln[1], self.cfg.eps, y32)
        return r.to_half(y32, h)

    # ------------------------------------------------------------------ prefill
    def prefill(self, ids: Any):
        """Run the prompt ``ids`` (B, T) through the model from position 0, filling the cache.
        Returns the logits of every position (B*T, vocab) fp16; the next token (greedy, or as
        set by ``sampling``) is in ``tok`` and ``pos`` = T."""
        import cupy as cp
        import numpy as np

        ids = np.asarray(ids.cpu() if hasattr(ids, "cpu") else ids)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2 or ids.shape[0] != self.B:
            raise ValueError(f"ids must be ({self.B}, T) for batch {self.B}, got {ids.shape}")
        B, T = ids.shape
        if T == 0:
            raise ValueError("empty prompt: at least one token is needed to predict the next")
        if T >= self.L:
            raise ValueError(f"a prompt of {T} tokens does not fit the cache of {self.L} "
                             "positions (and leaves none to generate)")
        cfg, k = self.cfg, self.k
        d, H, D, M = cfg.d, cfg.n_head, cfg.head_dim, B * T
        lo, hi = int(ids.min()), int(ids.max())            # checked on the host: no sync
        if lo < 0 or hi >= cfg.vocab:
            raise ValueError(f"token id {lo if lo < 0 else hi} is outside the vocabulary "
                             f"[0, {cfg.vocab})")
        tok = cp.asarray(ids.reshape(-1).astype(np.int32))
        x = k["embedding"].embedding(tok, self.wte, check_ids=False)
        h, a, dx = (cp.empty((M, d), cp.float16) for _ in range(3))
        qkv, f = cp.empty((M, 3 * d), cp.float16), cp.empty((M, 4 * d), cp.float16)
        q, kk, vv, o = (cp.empty((B, H, T, D), cp.float16) for _ in range(4))
        lse = cp.empty((B, H, T), cp.float32)
        for i, W in enumerate(self.layers):
            self._norm(x, dx if i else None, W["ln1"], h)
            self._mm(h, W["qkv"], qkv, False)
            k["rope"].rope_qkv(qkv, q, self.kc[i], self.vc[i], 0, None, kk, vv, cfg.rope_base)
            k["attention"].forward(q, kk, vv, causal=True, version="v3", out=(o, lse))
            k["kvcache"].merge_heads(o, a)
            self._mm(a, W["proj"], dx, False)
            self._norm(x, dx, W["ln2"], h)
            self._mm(h, W["fc"], f, False)
            k["gelu_half"].gelu_half(f)
            self._mm(f, W["fc2"], dx, False)
        self._norm(x, dx, self.lnf, h)
        logits = self._mm(h, self.head, cp.empty((M, cfg.vocab), cp.float16), False)
        last = cp.ascontiguousarray(logits.reshape(B, T, -1)[:, -1])
        k["sampling"].sample(last, self.u, self.tok, self.temperature, self.top_k, self.top_p)
        self.history[:] = 0
        self.history[:, :T] = cp.asarray(ids.astype(np.int32))
        self.history[:, T] = self.tok
        self.pos[0] = T
        self.host_pos = T
        self.logits[...] = last
        return logits

    # ------------------------------------------------------------------ decode
    def step(self) -> None:
        """One decode step on the GPU: token ``tok`` at position ``pos`` in, the next token in
        ``tok`` and ``pos + 1`` out. No host work depends on the GPU: capturable."""
        cfg, k, B = self.cfg, self.k, self.B
        H, D, pos = cfg.n_head, cfg.head_dim, self.pos
        k["embedding"].embedding(self.tok, self.wte, self.x, check_ids=False)
        for i, W in enumerate(self.layers):
            self._norm(self.x, self.dx if i else None, W["ln1"], self.h)
            self._mm(self.h, W["qkv"], self.qkv, True)
            if self.fuse_rope:
                k["rope"].rope_qkv(self.qkv, self.q, self.kc[i], self.vc[i], 0, pos,
                                   base=cfg.rope_base)
                q = self.q.reshape(B, H, D)
            else:
                v5 = self.qkv.reshape(B, 1, 3, H, D)
                k["rope"].rope(v5[:, 0, 0], 0, 1, pos, cfg.rope_base)
                k["rope"].rope(v5[:, 0, 1], 0, 1, pos, cfg.rope_base)
                k["kvcache"].kv_append(v5[:, :, 1], v5[:, :, 2], self.kc[i], self.vc[i], 0, pos)
                q = v5[:, 0, 0]
            k["kvcache"].decode_attention(q, self.kc[i], self.vc[i], self.a, 0, pos,
                                          version=self.attention)
            self._mm(self.a, W["proj"], self.dx, True)
            self._norm(self.x, self.dx, W["ln2"], self.h)
            self._mm(self.h, W["fc"], self.f, True)
            k["gelu_half"].gelu_half(self.f)
            self._mm(self.f, W["fc2"], self.dx, True)
        self._norm(self.x, self.dx, self.lnf, self.h)
        self._mm(self.h, self.head, self.logits, True)
        k["sampling"].sample(self.logits, self.u, self.tok, self.temperature, self.top_k,
                             self.top_p)
        k["kvcache"].advance(pos, self.tok, self.history)

    def _room(self, n: int) -> None:
        if self.host_pos + n > self.L - 1:
            raise ValueError(f"{n} more steps from position {self.host_pos} run past the cache "
                             f"of {self.L} positions")

    def decode(self, n: int = 1, graph: bool = True) -> None:
        """``n`` decode steps, replaying the captured graph (captured on first use) or eagerly."""
        self._room(n)
        if graph and self.graph is None:
            self.capture()
        for _ in range(n):
            self.graph() if graph else self.step()
        self.host_pos += n

    def capture(self):
        """The decode step as a CUDA graph (``cudabook.graphs.capture``); the warm-up step it
        runs first is undone (pos and tok restored; its cache writes are the ones the first
        replay makes again)."""
        from . import graphs

        self._room(1)
        tok, pos = self.tok.copy(), self.pos.copy()
        self.graph = graphs.capture(self.step, warmup=1)
        self.tok[...] = tok
        self.pos[...] = pos
        return self.graph

    def step_us(self, ids: Any, n: int = 100) -> float:
        """Microseconds per token of the decode step's CUDA graph (``capture``; ``graph.nodes``
        counts its kernels), replayed ``n`` times back to back after the prefill of ``ids``
        (B, T), from position T each time (``timed_step``: the greedy token checked against the
        logits before and after timing). Greedy decoding only."""
        if self.temperature > 0:
            raise ValueError("step_us checks the greedy token: call it before sampling()")
        self.prefill(ids)
        self._room(n + 3)
        g = self.capture()
        T, tok = self.host_pos, self.tok.copy()

        def reset() -> None:
            self.pos[...] = T
            self.tok[...] = tok

        def check(when: str) -> None:
            check_next_token(self.logits, self.tok, f"the book's decode step {when}")

        return timed_step(g, reset, check, n)

    def generate(self, prompt: Any, n: int, graph: bool = True):
        """Greedy (or ``sampling``) continuation of ``prompt`` by ``n`` tokens: (ids (B, n) as a
        NumPy array, logits (n, B, vocab) float32 NumPy of every step)."""
        import cupy as cp

        logits = [None] * n
        if self.temperature > 0:
            self.reseed()
        self.prefill(prompt)
        self._room(n - 1)
        logits[0] = self.logits.astype(cp.float32)
        for i in range(1, n):
            if self.temperature > 0:
                self.reseed()
            self.decode(1, graph)
            logits[i] = self.logits.astype(cp.float32)
        T = self.host_pos - n + 1
        ids = cp.asnumpy(self.history[:, T:T + n])
        return ids, cp.asnumpy(cp.stack(logits))

    def sampling(self, temperature: float = 1.0, top_k: int = 40, top_p: float = 1.0,
                 seed: int = 0) -> None:
        """Sample instead of greedy: ``u`` is refilled from a seeded generator by ``reseed()``."""
        import cupy as cp

        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
        self.rng = cp.random.default_rng(seed)
        self.graph = None                      # the graph holds the old arguments

    def reseed(self) -> None:
        """New uniform numbers for the next sampling step (on the current stream)."""
        import cupy as cp

        self.u[...] = self.rng.random(self.B, dtype=cp.float32)

    # ------------------------------------------------------------------ where the time goes
    def op_times(self, repeat: int = 50) -> dict[str, float]:
        """Microseconds per decode step spent in each kind of op: every group (that op for all
        layers, the arguments of ``step``) captured alone as a CUDA graph and replayed
        ``repeat`` times between CUDA events. The state a group changes (x, pos, tok, history)
        is restored afterwards."""

        from . import graphs

        cfg, k, B, pos = self.cfg, self.k, self.B, self.pos
        H, D, Ls = cfg.n_head, cfg.head_dim, self.layers
        q = self.q.reshape(B, H, D)
        each = lambda f: (lambda: [f(i, W) for i, W in enumerate(Ls)])  # noqa: E731
        groups = {
            "embedding": lambda: k["embedding"].embedding(self.tok, self.wte, self.x,
                                                          check_ids=False),
            "add + LayerNorm": lambda: [self._norm(self.x, self.dx, ln, self.h) for ln in
                                        [W[n] for W in Ls for n in ("ln1", "ln2")] + [self.lnf]],
            "QKV projection": each(lambda i, W: self._mm(self.h, W["qkv"], self.qkv, True)),
            "RoPE + cache append": each(lambda i, W: k["rope"].rope_qkv(
                self.qkv, self.q, self.kc[i], self.vc[i], 0, pos, base=cfg.rope_base)),
            "attention over the cache": each(lambda i, W: k["kvcache"].decode_attention(
                q, self.kc[i], self.vc[i], self.a, 0, pos, version=self.attention)),
            "output projection": each(lambda i, W: self._mm(self.a, W["proj"], self.dx, True)),
            "MLP matmuls": each(lambda i, W: (self._mm(self.h, W["fc"], self.f, True),
                                              self._mm(self.f, W["fc2"], self.dx, True))),
            "GELU": each(lambda i, W: k["gelu_half"].gelu_half(self.f)),
            "LM head": lambda: self._mm(self.h, self.head, self.logits, True),
            "sampling + advance": lambda: (k["sampling"].sample(
                self.logits, self.u, self.tok, self.temperature, self.top_k, self.top_p),
                k["kvcache"].advance(pos, self.tok, self.history)),
        }
        saved = [a.copy() for a in (self.x, self.pos, self.tok, self.history)]
        out = {}
        for name, fn in groups.items():
            out[name] = graphs.capture(fn, warmup=1).replay_us(repeat)
            for a, b in zip((self.x, self.pos, self.tok, self.history), saved):
                a[...] = b
        return out


# ============================================================================ PyTorch, run fast
class StaticCacheDecoder:
    """The same model's decode step in PyTorch, the way fast PyTorch decoders run it (gpt-fast).

        sd = decoder.StaticCacheDecoder(model, batch=1)   # cache at full length, pos on the GPU
        sd.prefill(ids)                                   # ids (B, T): cache filled, pos = T
        sd.step()                                         # tok at pos in; next tok, pos + 1 out
        run, why = sd.capture()                           # the step in one CUDA graph
        run, why = sd.capture(compiled=True)              # torch.compile'd, then captured

    What makes the step capturable: the KV cache is allocated once at its full length
    (n_layer, B, H, L, D); the position is a 0-d tensor on the GPU, so the new key and value go
    in with ``index_copy_`` at it, the RoPE rows come with ``index_select``, and attention runs
    over all L positions under the mask ``arange(L) <= pos``. Every shape is the same at every
    step: no Python slicing by position, nothing read back to the host. The price: attention
    reads the whole cache (L positions), not only the pos + 1 written ones.
    """

    def __init__(self, model: Any, batch: int = 1, length: int | None = None):
        import torch

        from . import gpt

        cfg = self.cfg = model.cfg
        self.model, self.B, self.L = model, int(batch), int(length or cfg.ctx)
        if self.B < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if not 2 <= self.L <= cfg.ctx:
            raise ValueError(f"length {self.L}: a cache holds 2 to {cfg.ctx} positions (the "
                             "model's RoPE tables end there)")
        p = next(model.parameters())
        dev, B = p.device, self.B
        self.cache = gpt.KVCache(cfg, B, dev, p.dtype, self.L)    # k, v: (n_layer, B, H, L, D)
        self.pos = torch.zeros((), dtype=torch.long, device=dev)   # 0-d: the step reads it
        self.tok = torch.zeros(B, 1, dtype=torch.long, device=dev)            # (B, 1) in, out
        self.logits = torch.zeros(B, cfg.vocab, dtype=torch.float32, device=dev)  # (B, vocab)
        self.ar = torch.arange(self.L, device=dev)                             # (L,)
        self.host_pos = 0                     # what pos holds, known without reading the GPU

    def prefill(self, ids: Any):
        """Run the prompt ``ids`` (B, T) through the model's own forward from position 0,
        filling the cache. Returns the logits (B, T, vocab) float32; the greedy next token is in
        ``tok`` and ``pos`` = T."""
        import torch

        ids = torch.as_tensor(ids)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2 or ids.shape[0] != self.B:
            raise ValueError(f"ids must be ({self.B}, T) for batch {self.B}, got "
                             f"{tuple(ids.shape)}")
        T = ids.shape[1]
        if T >= self.L:
            raise ValueError(f"a prompt of {T} tokens does not fit the static cache of {self.L} "
                             "positions (and leaves none to generate)")
        with torch.no_grad():
            lg = self.model(ids.to(self.ar.device), self.cache, 0)       # checks the ids
        self.logits.copy_(lg[:, -1])
        self.tok.copy_(lg[:, -1].argmax(-1, keepdim=True))
        self.reset(T)
        return lg

    def reset(self, pos: int) -> None:
        """Set the position (on the GPU and on the host); the cache is left as it is."""
        self.pos.fill_(int(pos))
        self.host_pos = int(pos)

    def step(self) -> None:
        """One decode step, device work only (capturable): token ``tok`` at position ``pos`` in;
        logits (B, vocab), the greedy next token and ``pos + 1`` out."""
        import torch
        import torch.nn.functional as F

        from .gpt import _rope

        m, B, cfg = self.model, self.B, self.cfg
        H, D, d = cfg.n_head, cfg.head_dim, cfg.d
        with torch.no_grad():
            p1 = self.pos.view(1)                               # (1,) index of this position
            cos, sin = m.cos.index_select(0, p1), m.sin.index_select(0, p1)    # (1, D/2)
            mask = (self.ar <= self.pos).view(1, 1, 1, self.L)  # attend to 0..pos of L
            x = m.wte(self.tok)                                 # (B, 1, d)
            for i, b in enumerate(m.blocks):
                qkv = b.qkv(b.ln1(x)).view(B, 1, 3, H, D).permute(2, 0, 3, 1, 4)
                q, k = _rope(qkv[0], cos, sin), _rope(qkv[1], cos, sin)       # (B, H, 1, D)
                K, V = self.cache.k[i], self.cache.v[i]         # (B, H, L, D)
                K.index_copy_(2, p1, k)                         # the new key, value at pos
                V.index_copy_(2, p1, qkv[2])
                o = F.scaled_dot_product_attention(q, K, V, attn_mask=mask)      # (B, H, 1, D)
                x = x + b.proj(o.transpose(1, 2).reshape(B, 1, d))
                x = x + b.fc2(F.gelu(b.fc(b.ln2(x)), approximate="tanh"))
            lg = m.head(m.ln_f(x)).float()[:, -1]               # (B, vocab)
            self.logits.copy_(lg)
            self.tok.copy_(lg.argmax(-1, keepdim=True))
            self.pos.add_(1)

    def _room(self, n: int) -> None:
        if self.host_pos + n > self.L:
            raise ValueError(f"{n} more steps from position {self.host_pos} run past the static "
                             f"cache of {self.L} positions")

    def runner(self, fn: Any, name: str = "step"):
        """``fn`` (the step, or a replay of it) behind a host-side check: a step past the cache
        would index out of range on the GPU, which no later call could recover from."""
        def run() -> None:
            self._room(1)
            fn()
            self.host_pos += 1

        run.__name__ = name
        return run

    def capture(self, compiled: bool = False):
        """``(run, None)``: the step captured in a CUDA graph (``cudabook.baselines.torch_graph``),
        ``torch.compile``d first if ``compiled``; ``run()`` replays it once. Or ``(None, why)``
        where torch.compile cannot run. The warm-up steps the capture runs are undone (position,
        token and logits restored; the replays write the same cache rows again)."""
        from . import baselines

        self._room(5)                          # the warm-up steps, and the trial of compile
        saved = (self.host_pos, self.tok.clone(), self.logits.clone())
        fn = self.step
        if compiled:
            fn, why = baselines.torch_compiled(self.step)
            if fn is None:
                return None, why
        name = "torch.compile + CUDA graph" if compiled else "PyTorch static cache + CUDA graph"
        g = baselines.torch_graph(fn, name=name)
        self.reset(saved[0])
        self.tok.copy_(saved[1])
        self.logits.copy_(saved[2])
        return self.runner(g, name), None

    def step_us(self, compiled: bool = False, n: int = 100):
        """``(us, None)``: microseconds per token of the step captured in a CUDA graph
        (``capture``, ``torch.compile``d first if ``compiled``), replayed ``n`` times back to back
        from the position ``prefill`` left (``timed_step``: the greedy token checked against
        the logits before and after timing). Or ``(None, why)`` where torch.compile cannot
        run."""
        T, tok = self.host_pos, self.tok.clone()
        self._room(n + 3)
        run, why = self.capture(compiled=compiled)
        if run is None:
            return None, why

        def reset() -> None:
            self.reset(T)
            self.tok.copy_(tok)

        def check(when: str) -> None:
            check_next_token(self.logits, self.tok.view(-1), f"{run.__name__} {when}")

        return timed_step(run, reset, check, n), None


def compare_static(model: Any, ids: Any, steps: int = 3, length: int | None = None
                   ) -> tuple[float, float]:
    """(largest |logit difference|, largest difference / its tolerance) between
    ``StaticCacheDecoder``'s steps and the model's own forward with its KV cache
    (``gpt.GPT.forward``: the growing Python slice), over ``steps`` steps after the prompt
    ``ids`` (B, T). Both are fed the reference's greedy tokens. The tolerance is the one a decode
    step in fp16 is held to on this page: ``4 (n_layer + 1) u rms(logits) + u |logit|``,
    u = 2^-11."""
    import torch

    from . import gpt

    ids = torch.as_tensor(ids)
    ids = ids[None] if ids.ndim == 1 else ids
    B, T = ids.shape
    sd = StaticCacheDecoder(model, B, length)
    p = next(model.parameters())
    ref_cache = gpt.KVCache(model.cfg, B, p.device, p.dtype, sd.L)
    if T + steps > sd.L:
        raise ValueError(f"a prompt of {T} tokens and {steps} steps run past the cache of "
                         f"{sd.L} positions")
    u, err, frac = 2.0 ** -11, 0.0, 0.0
    with torch.no_grad():
        ref = model(ids.to(p.device), ref_cache, 0)[:, -1]      # (B, vocab) float32
        sd.prefill(ids)
        for s in range(steps):
            tok = ref.argmax(-1, keepdim=True)                  # (B, 1): the same input to both
            sd.tok.copy_(tok)
            sd.step()
            ref = model(tok, ref_cache, T + s, check=False)[:, -1]
            diff = (sd.logits - ref).abs()
            tol = (4 * (model.cfg.n_layer + 1) * u * ref.pow(2).mean(-1, keepdim=True).sqrt()
                   + u * ref.abs())
            err, frac = max(err, float(diff.max())), max(frac, float((diff / tol).max()))
    return err, frac


def check_next_token(logits: Any, tok: Any, name: str = "decode step") -> None:
    """Raise ``cudabook.CheckError`` unless every logit of the last step is finite and the
    token written for the following step is the largest logit's (the lower id on a tie): the check
    a timed decode step passes before and after it is timed."""
    import numpy as np

    from .check import CheckError, to_numpy

    lg = np.asarray(to_numpy(logits), dtype=np.float64)        # (B, vocab)
    t = np.asarray(to_numpy(tok)).reshape(-1)                   # (B,)
    if not np.isfinite(lg).all():
        raise CheckError(f"{name}: {int((~np.isfinite(lg)).sum())} logits are NaN or inf")
    want = lg.argmax(-1)
    if t.shape != want.shape or (t != want).any():
        i = int(np.flatnonzero(t != want)[0]) if t.shape == want.shape else 0
        raise CheckError(f"{name}: sequence {i} continues with token "
                         f"{t[i] if t.shape == want.shape else t.shape}, not with the largest "
                         f"logit's ({want[i]})")


def step_bytes(model: Any, batch: int, n: int) -> dict[str, int]:
    """Bytes one decode step of batch ``batch`` must read at ``n`` cached positions, counted
    from the model's own tensors: every parameter once (the embedding table excepted: only the
    batch's rows of it), and the keys and values of positions 0..n-1 of every layer (in the
    model's dtype). {"weights": ..., "cache": ..., "total": ...}."""
    cfg = model.cfg
    w = 0
    for name, p in model.named_parameters():
        rows = batch if name == "wte.weight" else p.shape[0]
        w += rows * (p.numel() // p.shape[0]) * p.element_size()
    size = next(model.parameters()).element_size()
    c = 2 * cfg.n_layer * batch * cfg.n_head * n * cfg.head_dim * size       # K and V
    return {"weights": w, "cache": c, "total": w + c}
