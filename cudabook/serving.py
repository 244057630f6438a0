"""Serving the GPT of ``cudabook.gpt`` to many requests at once, on a paged KV cache (Chapter 12).

    from cudabook import gpt, serving
    model = gpt.build(gpt.GPT2_SMALL, device="cuda")             # or gpt.load_tiny()[0]
    eng = serving.PagedGPT(model, slots=32, max_len=1024)
    reqs = serving.workload(64, vocab=model.cfg.vocab, seed=0)   # prompts and output lengths
    run = eng.serve(reqs)                                        # continuous batching
    pad = eng.serve(reqs, policy="static")                       # padded static batches
    run.tokens[req_id], run.summary()                            # what each request got, timings

A decode step here is chapter 7's step (``cudabook.decoder.KernelGPT``: the same weights, the
same embedding, LayerNorm, GELU and sampling kernels) with two changes that let the rows of a
batch be different requests at different positions, and a GEMV on the tensor cores
(``gemv_v6`` of kernels/gemv.cu, ``gemv=`` picks another: "gemv_v4" is chapter 10's, which
reads the weights once per 8 rows on CUDA cores):

* the QKV projection is rotated at each row's own position and appended into that row's blocks
  of a shared pool (``paged_rope_append_v1``), and attention reads each row's keys through its
  block table (``paged_decode_v2`` + ``paged_merge_v1``, split over the keys);
* the rows' tokens, lengths and block tables are inputs copied to the GPU before each step (one
  host-to-device copy of one int32 buffer), so one CUDA graph per batch size ("bucket": 1, 2, 4,
  ..., slots) serves any mix of requests. A step of 5 requests runs the bucket of 8; its 3 extra
  rows are padding that reads and writes one scratch block outside the pool.

A request's prompt runs through chapter 7's prefill (the same kernels as ``KernelGPT.prefill``,
batch 1), padded to a power of two and captured as one CUDA graph per padded length, its keys
and values written straight into its blocks (``paged_write_v1``).

Every kernel of the step computes a row the same way whatever else is in the batch (no
reduction across rows, the same GEMV at every batch size, a fixed split of the keys): a
request's tokens do not depend on who it shared its steps with, which ``serve`` lets a test
check bit for bit.

``fused=True`` runs the step on ``kernels/decode_gemv.cu`` (a decode-ladder step that did not
pay): LayerNorm folded into the GEMV that reads it, GELU and the residual add into the GEMV that
writes them, RoPE and the paged append into the QKV GEMV; 7 launches per layer instead of 10. On
the H200 it was no faster at batch 1 and several times slower from batch 2 (every block of a
GEMV normalises its rows again; reports/gpu-lane-2026-11-29-ch13-training.md has the numbers),
and its RoPE may round q and k one fp16 ulp away from the unfused step's (the compiler contracts
the rotation's products differently), so its tokens can differ from the unfused engine's. It
stays for study, not for use.

``policy="static"`` is the baseline: requests in arrival order, ``slots`` at a time; a batch runs
until its longest request is done, finished rows computed as padding, and the next batch waits.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import env
from .batching import ContinuousBatcher, Request
from .compile import load_launch
from .launch import version_name
from .paging import BlockAllocator, PagedTable

__all__ = ["PagedGPT", "ServeResult", "workload", "BUCKETS"]

#: the batch sizes a step is captured for; a step runs the smallest that holds its rows
BUCKETS = (1, 2, 4, 8, 16, 32)


def workload(n: int, vocab: int, prompt: tuple[int, int] = (16, 256),
             new: tuple[int, int] = (8, 384), seed: int = 0) -> list[Request]:
    """``n`` requests with prompt lengths and output lengths drawn uniformly from the closed
    ranges ``prompt`` and ``new``, random token ids: a mix like a server's, reproducible."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        lp = int(rng.integers(prompt[0], prompt[1] + 1))
        out.append(Request(i, rng.integers(0, vocab, lp).tolist(),
                           int(rng.integers(new[0], new[1] + 1))))
    return out


@dataclass
class ServeResult:
    """What ``PagedGPT.serve`` measured. Times are seconds from the start of the run."""
    policy: str
    tokens: dict                          # request id -> generated token ids
    first: dict                           # request id -> time its first token was known
    done: dict                            # request id -> time its last token was known
    wall: float                           # the whole run
    steps: int                            # decode steps
    rows: int                             # rows computed by those steps (buckets' padding in)
    useful_rows: int                      # rows that produced a token someone wanted
    peak_blocks: int                      # most cache blocks held at once
    prefill_s: float                      # time spent in prompts (prefill and the copy to blocks)
    bucket_rows: dict = field(default_factory=dict)    # bucket size -> steps run at that size
    timeline: list = field(default_factory=list)       # (time, rows wanted) of each decode step

    @property
    def generated(self) -> int:
        return sum(len(t) for t in self.tokens.values())

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.wall

    def latency(self, q: float = 50) -> float:
        """The q-th percentile over requests of the time to their last token (all requests
        arrive at time 0)."""
        return float(np.percentile(list(self.done.values()), q))

    def summary(self) -> str:
        return (f"{self.policy:>10}: {self.generated} tokens in {self.wall:.3f} s = "
                f"{self.tokens_per_s:,.0f} tokens/s; {self.steps} decode steps, "
                f"{self.rows} rows computed ({self.useful_rows / max(self.rows, 1):.0%} useful); "
                f"latency p50 {self.latency(50):.3f} s, p90 {self.latency(90):.3f} s; "
                f"peak cache {self.peak_blocks} blocks")


class _Bucket:
    """The buffers and the captured graph of a decode step of ``B`` rows."""

    def __init__(self, B: int, eng: PagedGPT):
        import cupy as cp

        cfg, MB = eng.cfg, eng.MB
        d, H, D = cfg.d, cfg.n_head, cfg.head_dim
        self.B = B
        self.host = cp.cuda.alloc_pinned_memory(4 * B * (2 + MB))
        self.hbuf = np.frombuffer(self.host, np.int32, B * (2 + MB))
        self.ints = cp.empty(B * (2 + MB), cp.int32)      # tok | seq_lens | block_table
        self.tok, self.lens = self.ints[:B], self.ints[B:2 * B]
        self.table = self.ints[2 * B:].reshape(B, MB)
        self.x = cp.empty((B, d), cp.float32)
        self.h, self.a, self.dx = (cp.empty((B, d), cp.float16) for _ in range(3))
        self.qkv, self.q = cp.empty((B, 3 * d), cp.float16), cp.empty((B, H, D), cp.float16)
        self.f = cp.empty((B, 4 * d), cp.float16)
        self.logits = cp.empty((B, cfg.vocab), cp.float16)
        self.u = cp.zeros(B, cp.float32)
        self.work = eng.pa.Workspace(B, H, D, eng.splits)
        self.graph = None

    def load(self, toks, lens, rows, scratch: int) -> None:
        """Fill the rows (the rest: padding on the scratch block) and copy them to the GPU."""
        B, n = self.B, len(toks)
        hb = self.hbuf
        hb[:] = -1
        hb[:n], hb[n:B] = toks, 0
        hb[B:B + n], hb[B + n:2 * B] = lens, 1
        tab = hb[2 * B:].reshape(B, -1)
        tab[:n] = rows
        tab[n:, 0] = scratch
        self.ints.set(hb)


class _Prefill:
    """Chapter 7's prefill of one prompt padded to ``T`` rows, with its buffers allocated once,
    so that it is captured as a CUDA graph: the prompt's ids, its length and its table row are
    inputs (one host-to-device copy), its keys and values go into its blocks, its first token
    comes out. Causal attention keeps the padding rows (after the prompt) out of the prompt's."""

    def __init__(self, T: int, eng: PagedGPT):
        import cupy as cp

        cfg, MB = eng.cfg, eng.MB
        d, H, D, h16 = cfg.d, cfg.n_head, cfg.head_dim, cp.float16
        self.T = T
        self.host = cp.cuda.alloc_pinned_memory(4 * (T + 2 + MB))
        self.hbuf = np.frombuffer(self.host, np.int32, T + 2 + MB)
        self.ints = cp.zeros(T + 2 + MB, cp.int32)        # ids | n | n - 1 | table row
        self.ids, self.n, self.last = self.ints[:T], self.ints[T:T + 1], self.ints[T + 1:T + 2]
        self.row = self.ints[T + 2:]
        self.x = cp.empty((T, d), cp.float32)
        self.h, self.a, self.dx = (cp.empty((T, d), h16) for _ in range(3))
        self.qkv, self.f = cp.empty((T, 3 * d), h16), cp.empty((T, 4 * d), h16)
        self.q, self.k, self.v, self.o = (cp.empty((1, H, T, D), h16) for _ in range(4))
        self.lse = cp.empty((1, H, T), cp.float32)
        self.x1, self.h1 = cp.empty((1, d), cp.float32), cp.empty((1, d), h16)
        self.logits, self.u = cp.empty((1, cfg.vocab), h16), cp.zeros(1, cp.float32)
        self.tok = cp.zeros(1, cp.int32)
        self.graph = None

    def load(self, prompt, row) -> None:
        n, hb, T = len(prompt), self.hbuf, self.T
        hb[:] = 0
        hb[:n] = prompt
        hb[T], hb[T + 1] = n, n - 1
        hb[T + 2:] = row
        self.ints.set(hb)


class PagedGPT:
    """The GPT's decode step over a paged KV cache for up to ``slots`` requests at once."""

    def __init__(self, model: Any, slots: int = 32, max_len: int | None = None,
                 block_size: int = 16, num_blocks: int | None = None,
                 splits: int | None = None, fused: bool = False, gemv: str = "gemv_v6"):
        if not env.HAS_GPU:
            raise RuntimeError("PagedGPT runs CUDA C++ kernels: it needs a CUDA GPU")
        import cupy as cp

        from .decoder import KernelGPT

        cfg = self.cfg = model.cfg
        if not 1 <= slots <= BUCKETS[-1]:
            raise ValueError(f"slots must be in 1..{BUCKETS[-1]} (the batched GEMV's rows), "
                             f"got {slots}")
        self.slots = int(slots)
        self.max_len = int(max_len or cfg.ctx)
        if not 2 <= self.max_len <= cfg.ctx:
            raise ValueError(f"max_len must be in 2..{cfg.ctx} (the model's context), got "
                             f"{max_len}")
        self.BS = int(block_size)
        self.MB = math.ceil(self.max_len / self.BS)
        NB = int(num_blocks or self.slots * self.MB)
        # the weights and kernels of chapter 7's decoder (its own buffers are left unused)
        self.dense = KernelGPT(model, batch=1, length=2)
        self.pa = load_launch("paged_attention")
        H, D = cfg.n_head, cfg.head_dim
        # the keys' split is fixed for every bucket (a row's sums in the same order at any batch
        # size); by default a split holds as many keys as a block has threads
        per = max(1, self.pa.THREADS // self.BS)
        self.splits, _ = self.pa.plan(1, H, self.MB, self.BS, splits or -(-self.MB // per))
        # block NB is the scratch block padding rows write: not in the allocator
        self.k_pool = cp.zeros((cfg.n_layer, NB + 1, H, self.BS, D), cp.float16)
        self.v_pool = cp.zeros_like(self.k_pool)
        self.scratch = NB
        self.table = PagedTable(BlockAllocator(NB, self.BS), self.slots, self.MB)
        self.buckets = {B: _Bucket(B, self) for B in BUCKETS if B < self.slots} | \
            {self.slots: _Bucket(self.slots, self)}
        self.prefills: dict[int, _Prefill] = {}          # padded prompt length -> its graph
        # one GEMV version for every bucket, so a row is summed the same way at any batch size:
        # gemv_v6 (tensor cores, K split by K alone) by default; "auto" is Chapter 10's choice
        self.gemv_version = gemv if gemv == "auto" else \
            version_name(self.dense.gemv.VERSIONS, gemv, "gemv")
        self.fused = bool(fused)
        if self.fused:                   # decode_gemv.cu: LayerNorm, GELU, residual, RoPE fused
            self.dg = load_launch("decode_gemv")
            order = cp.asarray(self.dg.rope_order(H, H, D))
            self.wqkv = [cp.ascontiguousarray(W["qkv"][order]) for W in self.dense.layers]

    # ------------------------------------------------------------------ the step
    def _mm(self, a, W, out) -> None:
        """out = a @ W^T for a decode step's rows: chapter 10's GEMV (1 to 32 rows), the same
        version at every batch size (``gemv``)."""
        self.dense.gemv.gemv(a, W, out=out, version=self.gemv_version)

    def _step(self, bk: _Bucket) -> None:
        """One decode step of bucket ``bk`` on the GPU: tokens in ``tok`` at lengths ``lens``
        (the new token counted) in, the next tokens (greedy) in ``tok``. Capturable."""
        k, g, cfg, pa = self.dense.k, self.dense, self.cfg, self.pa
        B, H, D = bk.B, cfg.n_head, cfg.head_dim
        k["embedding"].embedding(bk.tok, g.wte, bk.x, check_ids=False)
        for i, W in enumerate(g.layers):
            k["residual"].add_layernorm(bk.x, bk.dx if i else None, W["ln1"][0], W["ln1"][1],
                                        bk.h, cfg.eps)
            self._mm(bk.h, W["qkv"], bk.qkv)
            pa.rope_append(bk.qkv, bk.q, self.k_pool[i], self.v_pool[i], bk.table, bk.lens,
                           cfg.rope_base)
            pa.decode(bk.q, self.k_pool[i], self.v_pool[i], bk.table, bk.lens,
                      out=bk.a.reshape(B, H, D), work=bk.work)
            self._mm(bk.a, W["proj"], bk.dx)
            k["residual"].add_layernorm(bk.x, bk.dx, W["ln2"][0], W["ln2"][1], bk.h, cfg.eps)
            self._mm(bk.h, W["fc"], bk.f)
            k["gelu_half"].gelu_half(bk.f)
            self._mm(bk.f, W["fc2"], bk.dx)
        k["residual"].add_layernorm(bk.x, bk.dx, g.lnf[0], g.lnf[1], bk.h, cfg.eps)
        self._mm(bk.h, g.head, bk.logits)
        k["sampling"].sample(bk.logits, bk.u, bk.tok, 0.0, 1, 1.0)

    def _step_fused(self, bk: _Bucket) -> None:
        """The same step with decode_gemv.cu's fused GEMVs: per layer, LayerNorm + QKV + RoPE +
        paged append; paged attention (two kernels); output projection + residual; LayerNorm +
        up projection + GELU; down projection + residual (7 launches where ``_step`` has 10).
        The roundings of ``_step`` except RoPE's (one fp16 ulp, see the module docstring).
        Capturable."""
        k, g, cfg, pa, dg = self.dense.k, self.dense, self.cfg, self.pa, self.dg
        B, H, D = bk.B, cfg.n_head, cfg.head_dim
        k["embedding"].embedding(bk.tok, g.wte, bk.x, check_ids=False)
        for i, W in enumerate(g.layers):
            dg.decode_gemv(bk.x, self.wqkv[i], ln=(W["ln1"][0], W["ln1"][1], cfg.eps),
                           rope=dict(q_out=bk.q, k_pool=self.k_pool[i], v_pool=self.v_pool[i],
                                     block_table=bk.table, seq_lens=bk.lens,
                                     base=cfg.rope_base))
            pa.decode(bk.q, self.k_pool[i], self.v_pool[i], bk.table, bk.lens,
                      out=bk.a.reshape(B, H, D), work=bk.work)
            dg.decode_gemv(bk.a, W["proj"], residual=bk.x)
            dg.decode_gemv(bk.x, W["fc"], bk.f, ln=(W["ln2"][0], W["ln2"][1], cfg.eps), gelu=True)
            dg.decode_gemv(bk.f, W["fc2"], residual=bk.x)
        dg.decode_gemv(bk.x, g.head, bk.logits, ln=(g.lnf[0], g.lnf[1], cfg.eps))
        k["sampling"].sample(bk.logits, bk.u, bk.tok, 0.0, 1, 1.0)

    def op_times(self, bk: _Bucket, repeat: int = 50) -> dict[str, float]:
        """Microseconds per decode step of bucket ``bk`` (its rows as last loaded) in each kind of
        op: every group (that op for all layers) captured alone as a CUDA graph and replayed
        ``repeat`` times between CUDA events (``KernelGPT.op_times``' method). The state a group
        changes (x, tok and the pool rows the append writes again) is restored afterwards."""

        from . import graphs

        k, g, cfg, pa = self.dense.k, self.dense, self.cfg, self.pa
        B, H, D, Ls = bk.B, cfg.n_head, cfg.head_dim, g.layers
        each = lambda f: (lambda: [f(i, W) for i, W in enumerate(Ls)])  # noqa: E731
        norm = k["residual"].add_layernorm
        groups = {
            "embedding": lambda: k["embedding"].embedding(bk.tok, g.wte, bk.x, check_ids=False),
            "add + LayerNorm": lambda: [norm(bk.x, bk.dx, ln[0], ln[1], bk.h, cfg.eps) for ln in
                                        [W[n] for W in Ls for n in ("ln1", "ln2")] + [g.lnf]],
            "QKV projection": each(lambda i, W: self._mm(bk.h, W["qkv"], bk.qkv)),
            "RoPE + paged append": each(lambda i, W: pa.rope_append(
                bk.qkv, bk.q, self.k_pool[i], self.v_pool[i], bk.table, bk.lens, cfg.rope_base)),
            "paged attention": each(lambda i, W: pa.decode(
                bk.q, self.k_pool[i], self.v_pool[i], bk.table, bk.lens,
                out=bk.a.reshape(B, H, D), work=bk.work)),
            "output projection": each(lambda i, W: self._mm(bk.a, W["proj"], bk.dx)),
            "MLP matmuls": each(lambda i, W: (self._mm(bk.h, W["fc"], bk.f),
                                              self._mm(bk.f, W["fc2"], bk.dx))),
            "GELU": each(lambda i, W: k["gelu_half"].gelu_half(bk.f)),
            "LM head": lambda: self._mm(bk.h, g.head, bk.logits),
            "sampling": lambda: k["sampling"].sample(bk.logits, bk.u, bk.tok, 0.0, 1, 1.0),
        }
        if self.fused:
            dg, ln = self.dg, (lambda W, n: (W[n][0], W[n][1], cfg.eps))
            groups = {
                "embedding": groups["embedding"],
                "LayerNorm + QKV + RoPE + paged append": each(lambda i, W: dg.decode_gemv(
                    bk.x, self.wqkv[i], ln=ln(W, "ln1"), rope=dict(
                        q_out=bk.q, k_pool=self.k_pool[i], v_pool=self.v_pool[i],
                        block_table=bk.table, seq_lens=bk.lens, base=cfg.rope_base))),
                "paged attention": groups["paged attention"],
                "output projection + residual": each(lambda i, W: dg.decode_gemv(
                    bk.a, W["proj"], residual=bk.x)),
                "LayerNorm + MLP + GELU + residual": each(lambda i, W: (
                    dg.decode_gemv(bk.x, W["fc"], bk.f, ln=ln(W, "ln2"), gelu=True),
                    dg.decode_gemv(bk.f, W["fc2"], residual=bk.x))),
                "LayerNorm + LM head": lambda: dg.decode_gemv(bk.x, g.head, bk.logits,
                                                              ln=(g.lnf[0], g.lnf[1], cfg.eps)),
                "sampling": groups["sampling"],
            }
        saved = (bk.x.copy(), bk.tok.copy(), self.k_pool.copy(), self.v_pool.copy())
        out = {name: graphs.capture(fn, warmup=1).replay_us(repeat) for name, fn in groups.items()}
        for a, b in zip((bk.x, bk.tok, self.k_pool, self.v_pool), saved):
            a[...] = b
        return out

    def bucket(self, n: int) -> _Bucket:
        """The smallest captured batch size that holds ``n`` rows (captured on first use, on
        padding rows only: the capture's warm-up step writes nothing but the scratch block)."""
        if not 1 <= n <= self.slots:
            raise ValueError(f"{n} rows: a step holds 1..{self.slots}")
        bk = self.buckets[min(B for B in self.buckets if B >= n)]
        if bk.graph is None:
            from . import graphs

            bk.load([], [], np.empty((0, self.MB), np.int32), self.scratch)
            step = self._step_fused if self.fused else self._step
            bk.graph = graphs.capture(lambda: step(bk), warmup=1)
        return bk

    def decode(self, slots: list[int], tokens: list[int]) -> np.ndarray:
        """One decode step of the requests in ``slots`` (their tables already grown for the new
        token), fed ``tokens``: returns the next token of each (host, int32)."""
        bk = self.bucket(len(slots))
        t = self.table
        bk.load(tokens, t.seq_lens[slots], t.block_table[slots], self.scratch)
        bk.graph()
        return bk.tok[:len(slots)].get()

    def _prefill_step(self, pf: _Prefill) -> None:
        """Chapter 7's prefill (``KernelGPT.prefill``: the same kernels) on ``pf``'s buffers,
        writing the keys and values into the blocks of ``pf.row``. Capturable."""
        k, g, cfg, pa = self.dense.k, self.dense, self.cfg, self.pa
        k["embedding"].embedding(pf.ids, g.wte, pf.x, check_ids=False)
        for i, W in enumerate(g.layers):
            k["residual"].add_layernorm(pf.x, pf.dx if i else None, W["ln1"][0], W["ln1"][1],
                                        pf.h, cfg.eps)
            g._mm(pf.h, W["qkv"], pf.qkv, False)
            k["rope"].rope_qkv(pf.qkv, pf.q, pf.k, pf.v, 0, None, base=cfg.rope_base)
            pa.write_prompt(pf.k[0], pf.v[0], self.k_pool[i], self.v_pool[i], pf.row, pf.n)
            k["attention"].forward(pf.q, pf.k, pf.v, causal=True, version="v3",
                                   out=(pf.o, pf.lse))
            k["kvcache"].merge_heads(pf.o, pf.a)
            g._mm(pf.a, W["proj"], pf.dx, False)
            k["residual"].add_layernorm(pf.x, pf.dx, W["ln2"][0], W["ln2"][1], pf.h, cfg.eps)
            g._mm(pf.h, W["fc"], pf.f, False)
            k["gelu_half"].gelu_half(pf.f)
            g._mm(pf.f, W["fc2"], pf.dx, False)
        k["residual"].add_layernorm(pf.x, pf.dx, g.lnf[0], g.lnf[1], pf.h, cfg.eps)
        k["embedding"].embedding(pf.last, pf.h, pf.x1, check_ids=False)   # the prompt's last row
        k["residual"].to_half(pf.x1, pf.h1)
        g._mm(pf.h1, g.head, pf.logits, True)
        k["sampling"].sample(pf.logits, pf.u, pf.tok, 0.0, 1, 1.0)

    def prefill_graph(self, n: int) -> _Prefill:
        """The captured prefill for a prompt of ``n`` tokens: padded to the next power of two
        (at least 16), captured on first use on a prompt of one token with no blocks."""
        if not 1 <= n < self.max_len:
            raise ValueError(f"a prompt of {n} tokens: 1..{self.max_len - 1} fit")
        T = max(16, 1 << (n - 1).bit_length())
        pf = self.prefills.get(T)
        if pf is None:
            from . import graphs

            pf = self.prefills[T] = _Prefill(T, self)
            pf.load([0], np.full(self.MB, -1, np.int32))    # writes no block
            pf.graph = graphs.capture(lambda: self._prefill_step(pf), warmup=1)
        return pf

    def prefill(self, slot: int, prompt: list[int]) -> int:
        """Run ``prompt`` through the model (one graph replay) with its keys and values going
        into the blocks of ``slot`` (admitted with the prompt's length): returns the first new
        token."""
        pf = self.prefill_graph(len(prompt))
        pf.load(prompt, self.table.block_table[slot])
        pf.graph()
        return int(pf.tok.get()[0])

    # ------------------------------------------------------------------ serving
    def _fresh(self, requests: list[Request]) -> list[Request]:
        ids = [r.id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("two requests share an id")
        for r in requests:
            if r.total > self.max_len:
                raise ValueError(f"request {r.id!r}: {len(r.prompt)} prompt tokens + "
                                 f"{r.max_new_tokens} new need {r.total} positions; the cache "
                                 f"holds {self.max_len} per request")
            if min(r.prompt) < 0 or max(r.prompt) >= self.cfg.vocab:
                raise ValueError(f"request {r.id!r}: a token id outside [0, {self.cfg.vocab})")
        return [Request(r.id, list(r.prompt), r.max_new_tokens, r.eos) for r in requests]

    def serve(self, requests: list[Request], policy: str = "continuous",
              batch: int | None = None) -> ServeResult:
        """Generate every request's tokens (greedy), all requests arriving at time 0, under
        ``policy`` "continuous" (admitted and retired every step) or "static" (``batch`` at a
        time, padded to the longest; ``batch`` defaults to ``slots``). Nothing may be in
        flight from an earlier call."""
        import cupy as cp

        if self.table.in_use.any():
            raise RuntimeError("serve: requests from an earlier run are still in the table")
        if policy not in ("continuous", "static"):
            raise ValueError(f"policy must be 'continuous' or 'static', got {policy!r}")
        if policy == "continuous" and batch not in (None, self.slots):
            raise ValueError(f"continuous batching fills all {self.slots} slots; make a PagedGPT "
                             f"with slots={batch} for another batch size")
        batch = int(batch or self.slots)
        if not 1 <= batch <= self.slots:
            raise ValueError(f"batch must be in 1..{self.slots}, got {batch}")
        reqs = self._fresh(requests)
        for n in {min(B for B in self.buckets if B >= m) for m in range(1, batch + 1)}:
            self.bucket(n)                                 # capture outside the timed run
        for n in {len(r.prompt) for r in reqs}:
            self.prefill_graph(n)
        cp.cuda.Device().synchronize()
        run = _Run(policy, time.perf_counter())
        if policy == "continuous":
            self._continuous(reqs, run)
        else:
            self._static(reqs, batch, run)
        return run.result(reqs, cp.cuda.Device().synchronize)

    def _prefill_into(self, slot, req, run) -> int:
        t0 = time.perf_counter()
        tok = self.prefill(slot, req.prompt)
        run.prefill_s += time.perf_counter() - t0
        run.first[req.id] = time.perf_counter() - run.t0
        return tok

    def _continuous(self, reqs, run) -> None:
        sched = ContinuousBatcher(self.table)
        for r in reqs:
            sched.submit(r)
        while not sched.idle:
            for slot, req in sched.admit():                # free slots: run their prompts
                sched.commit(slot, self._prefill_into(slot, req, run))
                if req.done:
                    run.done[req.id] = time.perf_counter() - run.t0
            slots = sched.decoding()                       # tables grown for the new token
            run.peak = max(run.peak, self.table.alloc.num_blocks - self.table.alloc.free)
            if not slots:
                continue
            now_reqs = [sched.running[s] for s in slots]
            toks = self.decode(slots, [r.out[-1] for r in now_reqs])
            run.count(self.bucket(len(slots)).B, len(slots))
            now = time.perf_counter() - run.t0
            for s, r, t in zip(slots, now_reqs, toks):
                sched.commit(s, int(t))                    # a finished request leaves here
                if r.done:
                    run.done[r.id] = now

    def _static(self, reqs, batch, run) -> None:
        t = self.table
        for i in range(0, len(reqs), batch):
            group = reqs[i:i + batch]
            steps = max(r.max_new_tokens for r in group) - 1
            longest = max(len(r.prompt) for r in group) + steps
            if longest > t.capacity:
                raise ValueError(f"static batch {i // batch}: padded to {longest} positions, "
                                 f"more than a row holds ({t.capacity})")
            slots = []
            for r in group:
                slots.append(t.admit(len(r.prompt)))
                r.out.append(self._prefill_into(slots[-1], r, run))
                if r.done:
                    run.done[r.id] = time.perf_counter() - run.t0
            for _ in range(steps):                         # until the longest is done
                if all(r.done for r in group):             # every one stopped early (eos)
                    break
                for s in slots:
                    t.grow(s)
                run.peak = max(run.peak, t.alloc.num_blocks - t.alloc.free)
                live = [not r.done for r in group]
                toks = self.decode(slots, [r.out[-1] for r in group])
                run.count(self.bucket(len(slots)).B, sum(live))
                now = time.perf_counter() - run.t0
                for r, alive, tk in zip(group, live, toks):
                    if alive:                              # a finished row is padding: dropped
                        r.out.append(int(tk))
                        if r.done:
                            run.done[r.id] = now
            for s in slots:
                t.retire(s)


class _Run:
    def __init__(self, policy: str, t0: float):
        self.policy, self.t0 = policy, t0
        self.first, self.done = {}, {}
        self.steps = self.rows = self.useful = self.peak = 0
        self.prefill_s = 0.0
        self.bucket_rows: dict[int, int] = {}
        self.timeline: list[tuple[float, int]] = []

    def count(self, bucket: int, useful: int) -> None:
        self.timeline.append((time.perf_counter() - self.t0, useful))
        self.steps += 1
        self.rows += bucket
        self.useful += useful
        self.bucket_rows[bucket] = self.bucket_rows.get(bucket, 0) + 1

    def result(self, reqs, sync) -> ServeResult:
        sync()                                      # the last step's work is done
        wall = time.perf_counter() - self.t0
        return ServeResult(self.policy, {r.id: list(r.out) for r in reqs}, self.first,
                           self.done, wall, self.steps, self.rows, self.useful, self.peak,
                           self.prefill_s, dict(sorted(self.bucket_rows.items())),
                           self.timeline)
