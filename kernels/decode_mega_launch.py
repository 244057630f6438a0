"""Launching kernels/decode_mega.cu: a whole decode step of chapter 7's GPT in one kernel.

    from cudabook import decoder, gpt
    dm = cb.load_launch("decode_mega")
    mk = dm.megakernel(model, batch=1)              # builds the book's KernelGPT (weights, cache)
    mk = dm.megakernel(run)                         # or on a KernelGPT's own buffers
    mk.run.prefill(ids); mk.step()                  # tok at pos in: logits, the greedy tok, pos + 1
    g = mk.capture(); g()                           # the step as a CUDA graph (one kernel node)
    ids, logits = mk.generate(prompt, 32)           # the book's prefill, then megakernel steps
    mk.phase_times()                                # each phase alone (with the barriers), us
    mk.step_us(ids)                                 # us per token of the graph, checked

  VERSIONS (lesson 12's ladder, v1-v5), RING_VERSIONS (v6, v7), ALL_VERSIONS, WHAT, MIN_CC,
  BATCHES, THREADS, HEAD_DIM, MAX_D, KSMAX, ATT_PASS, RING, PHASES, ALL_PHASES
  check_model(cfg, batch, length)                   the shape refusals (no GPU needed)
  splits(cfg, batch, length, grid, version)         attention's splits of the keys per head
                                                    (v4, v5: the most; the kernel picks fewer)
  active_splits(keys, S)                            v4, v5: the splits the kernel takes for
                                                    ``keys`` (pos + 1) keys (mg_splits_v4)
  shared_bytes(cfg, batch, S, version, grid)        dynamic shared memory a block
  slot_bytes(cfg, grid)                             v6: one slot of the weight ring
  config(cfg, batch, length, version, sms, blocks_per_sm) -> Launch
  megakernel(source, batch, length, version, blocks_per_sm) -> MegaStep     the entry point
  reference_logits(model64, prompt, feed, length)   float64 logits of the model's own forward
  compare(mk, book, model64, prompt, steps, start)  megakernel vs the book's step vs float64
  greedy_agreement(mk, book, prompt, n)             both engines' greedy tokens, near ties named
  sanitize_targets()

The step reads and writes the KernelGPT's buffers: its fp16 weights and fp32 LayerNorm
parameters, its caches kc, vc (n_layer, B, H, L, D), tok (B,), pos (1,), history (B, L + 1) and
logits (B, vocab) fp16; a step is KernelGPT.step at temperature 0 (greedy), in one launch. The
megakernel keeps its own scratch (x, q, a, f, attention partials, tickets, the barrier's words).

Refused before anything touches CUDA (``check_model``): a batch outside BATCHES, a head
dimension other than 64, d not a multiple of 128 or above MAX_D, a cache shorter than 2. Then:
no GPU or compute capability below MIN_CC, sampling (temperature > 0), weights that are not
16-byte aligned or of the wrong shape, more blocks per SM than the driver says fit (the grid
barrier needs every block resident), shared memory past the GPU's limit.

The kernel cannot raise; what it meets at run time sets a bit in its error word and the step
does nothing until ``reset()``: a position outside the cache, a token outside the vocabulary
(NaN logits give token 2^31 - 1, refused by the next step), a barrier that waited
MEGA_TIMEOUT_NS (blocks not co-resident). ``errors()`` reads the word (a host sync).
"""

from __future__ import annotations

import math

import numpy as np

import cudabook as cb
from cudabook.launch import Launch, LaunchError, ceil_div, version_name

__all__ = ["VERSIONS", "RING_VERSIONS", "W4_VERSIONS", "W4_GROUP", "ALL_VERSIONS", "WHAT", "MIN_CC", "BATCHES", "THREADS",
           "HEAD_DIM", "MAX_D", "KSMAX",
           "ATT_PASS", "RING", "PHASES", "ALL_PHASES", "check_model", "splits", "active_splits",
           "shared_bytes", "slot_bytes", "config", "megakernel", "MegaStep", "reference_logits",
           "compare", "greedy_agreement", "dequantized_model", "sanitize_targets"]

VERSIONS = ("decode_mega_v1", "decode_mega_v2", "decode_mega_v3", "decode_mega_v4",
            "decode_mega_v5")          # the ladder lesson 12 walks
# The weight ring: correct (v4 bit for bit) and measured, not faster than v4 on the H200 (reports/
# gpu-lane-2026-11-29-tp-graphs-mega-ring.md); not in the lesson's ladder yet. Its slots need
# more shared memory than GPUs with few or small SMs give (then megakernel() refuses it).
RING_VERSIONS = ("decode_mega_v6", "decode_mega_v7")
# v8: v4 with W4A16 weights (chapter 10's int4 format, group 128), quantized by the launcher from
# the KernelGPT's fp16 weights (qgemv_launch.prepare); its reference is the dequantized model
# (dequantized_model), not the fp16 one.
W4_VERSIONS = ("decode_mega_v8",)
W4_GROUP = 128                  # MEGA_W4_GROUP
ALL_VERSIONS = VERSIONS + RING_VERSIONS + W4_VERSIONS
WHAT = {"decode_mega_v1": "one persistent kernel, grid barriers between the phases",
        "decode_mega_v2": "v1 + L2 prefetch of the next phases' weights across barriers, "
                          "4 LM-head rows per warp",
        "decode_mega_v3": "v2 + a one-word grid barrier (release add, acquire poll), attention "
                          "with every warp busy and no last-block combine (the proj phase "
                          "combines), the layer's K/V prefetched to L2 before the barrier",
        "decode_mega_v4": "v3 without the K/V prefetch, with the splits per head chosen from the "
                          "length on the GPU (one 128-key pass each) and a combine whose L2 "
                          "reads are all in flight at once",
        "decode_mega_v5": "v4 with 4 grid barriers a layer: attention waits for its own head's "
                          "q, k, v (a count per head) instead of a barrier after QKV",
        "decode_mega_v6": "v4 with each block's share of the weights copied into a ring of "
                          "shared memory (cp.async) two GEMV phases ahead, across the barriers",
        "decode_mega_v7": "v6 with the ring filled by the copy engine (bulk copies completing on "
                          "an mbarrier per slot; below sm_90, where there are none, it is v6)",
        "decode_mega_v8": "v4 with W4A16 weights: QKV, proj, fc, fc2 and the LM head in chapter "
                          "10's int4 format (an fp16 scale per 128 weights), 4x fewer bytes"}
MIN_CC = (8, 0)
BATCHES = (1, 2, 4, 8)          # compiled per batch (-DMEGA_B)
THREADS = 256                   # MEGA_THREADS
HEAD_DIM = 64                   # MEGA_HD
MAX_D = 1024                    # a warp holds a row of the LayerNorm in registers
KSMAX = 1024                    # MEGA_KSMAX: keys of one attention split
ATT_PASS = 128                  # MEGA_ATT_PASS: keys of one pass of v3's attention (v4's split)
PHASES = {"qkv": 1, "attention": 2, "proj": 4, "fc": 8, "fc2": 16, "head": 32}
ALL_PHASES = 63
ERRORS = {1: "a grid barrier timed out (the blocks were not all resident: another kernel on the "
             "GPU, this step launched on two streams at once, MPS or a smaller partition?)",
          2: "the position is outside the cache", 4: "a token is outside the vocabulary "
                                                     "(2^31 - 1: the last logits were NaN)"}


def _int(v, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{what} must be an int, got {v!r}")
    return int(v)


def check_model(cfg, batch: int, length: int) -> None:
    """LaunchError naming the first shape the megakernel does not take (no GPU needed)."""
    batch, length = _int(batch, "batch"), _int(length, "length")
    if batch not in BATCHES:
        up = next((b for b in BATCHES if b >= batch), None)
        raise LaunchError(f"decode_mega is compiled for batch {', '.join(map(str, BATCHES))}; "
                          f"got {batch}" + (f" (pad the batch to {up})" if up and batch > 0
                                            else ""))
    if cfg.n_head < 1 or cfg.d % cfg.n_head:
        raise LaunchError(f"d = {cfg.d} is not a multiple of n_head = {cfg.n_head}")
    if cfg.head_dim != HEAD_DIM:
        raise LaunchError(f"decode_mega takes head dimension {HEAD_DIM} (a thread's K row is 8 "
                          f"16-byte loads); this model has {cfg.head_dim} (d {cfg.d} / "
                          f"{cfg.n_head} heads)")
    if cfg.d % 128 or cfg.d > MAX_D:
        raise LaunchError(f"d = {cfg.d}: a warp normalises a row from registers, 4 floats per lane "
                          f"per pass, so d must be a multiple of 128 up to {MAX_D}")
    if cfg.n_layer < 1 or cfg.vocab < 1:
        raise LaunchError(f"n_layer = {cfg.n_layer}, vocab = {cfg.vocab}: both must be >= 1")
    if length < 2:
        raise LaunchError(f"a cache of {length} positions: at least 2 are needed")


# v3's attention and its combine; the splits chosen on the GPU from the length
_ONLINE = ("decode_mega_v3", "decode_mega_v4", "decode_mega_v5") + RING_VERSIONS + W4_VERSIONS
_BY_LENGTH = ("decode_mega_v4", "decode_mega_v5") + RING_VERSIONS + W4_VERSIONS
RING = 3                        # MEGA_RING's default: slots of the ring (weight phases in flight
                                # while one is computed: RING - 1); -DMEGA_RING from ``ring``


def splits(cfg, batch: int, length: int, grid: int, version: str = "decode_mega_v2") -> int:
    """S: enough (batch, head, split) tasks for every block, and at most KSMAX keys a split
    (v1, v2: a split's scores sit in shared memory). v3 keeps no scores (an online softmax), so
    it takes at most one task per block: S = grid // (batch heads), at least 1. v4 and v5 get
    the same S as a maximum (it sizes the partials and shared memory); each step takes
    ``active_splits(pos + 1, S)`` of it."""
    if version_name(ALL_VERSIONS, version, "decode_mega") in _ONLINE:
        return max(1, grid // (batch * cfg.n_head))
    return max(ceil_div(grid, batch * cfg.n_head), ceil_div(length, KSMAX))


def active_splits(keys: int, S: int) -> int:
    """v4, v5: the splits per head of a step over ``keys`` (pos + 1) keys, as the kernel
    computes them from pos (mg_splits_v4): one pass of ATT_PASS keys a split, at least 1 and at
    most ``S`` (``splits``): clamp(ceil(keys / ATT_PASS), 1, S)."""
    keys, S = _int(keys, "keys"), _int(S, "S")
    if keys < 1 or S < 1:
        raise ValueError(f"keys = {keys}, S = {S}: both must be >= 1")
    return min(S, max(1, ceil_div(keys, ATT_PASS)))


def slot_bytes(cfg, grid: int) -> int:
    """v6: bytes of one ring slot, the largest share of one GEMV's weights a block of ``grid``
    copies (mg_slot_elems): 2 ceil(3d/2 / grid) rows of QKV (pairs), ceil(4d / grid) rows of fc
    (proj's share is smaller), ceil(d / grid) rows of fc2 (4d wide); fp16."""
    d, g = cfg.d, _int(grid, "grid")
    return 2 * max(2 * ceil_div(3 * d // 2, g) * d, ceil_div(4 * d, g) * d,
                   ceil_div(d, g) * 4 * d)


def shared_bytes(cfg, batch: int, S: int, version: str, grid: int = 132,
                 ring: int = RING) -> int:
    """Dynamic shared memory: the fc2 input (batch, 4d) fp16; v3 also needs, in the proj phase,
    the input (batch, d) fp16 and the combine's weights and denominators (batch H (S + 1)
    floats) side by side; v4 and v5 the input and batch H (2 S + 1) floats (each split's m or
    weight and l, each head's denominator), S the most splits; v6, v7 v4's, rounded up to 16
    bytes, and ``ring`` slots of ``slot_bytes(cfg, grid)`` behind it."""
    fc2 = batch * 4 * cfg.d * 2
    version = version_name(ALL_VERSIONS, version, "decode_mega")
    if version not in _ONLINE:
        return fc2
    per_split = 2 if version in _BY_LENGTH else 1
    base = max(fc2, batch * cfg.d * 2 + 4 * batch * cfg.n_head * (per_split * S + 1))
    if version in RING_VERSIONS:
        return (base + 15) // 16 * 16 + ring * slot_bytes(cfg, grid)
    return base


def _check_ring(ring) -> int:
    ring = _int(ring, "ring")
    if not 2 <= ring <= 8:
        raise LaunchError(f"ring = {ring}: the weight ring holds 2 to 8 slots (one computed, the "
                          "rest in flight)")
    return ring


def config(cfg, batch: int, length: int, version: str = "decode_mega_v2", sms: int = 132,
           blocks_per_sm: int = 1, ring: int = RING) -> Launch:
    """grid (sms x blocks_per_sm), THREADS threads, ``shared_bytes`` of dynamic shared memory
    (the fc2 input; v3-v5 at least the combine's too; v6, v7 the weight ring of ``ring``
    slots); ``splits`` S (v4-v7: the most) and the compile options (-DMEGA_B, -DMEGA_D; v6, v7
    -DMEGA_RING) as fields."""
    version = version_name(ALL_VERSIONS, version, "decode_mega")
    check_model(cfg, batch, length)
    sms, bps, ring = _int(sms, "sms"), _int(blocks_per_sm, "blocks_per_sm"), _check_ring(ring)
    if sms < 1 or bps < 1:
        raise LaunchError(f"sms = {sms}, blocks_per_sm = {bps}: both must be >= 1")
    grid = sms * bps
    S = splits(cfg, batch, length, grid, version)
    options = (f"-DMEGA_B={batch}", f"-DMEGA_D={cfg.d}")
    if version in RING_VERSIONS:
        options += (f"-DMEGA_RING={ring}",)
    return Launch((grid,), (THREADS,), shared=shared_bytes(cfg, batch, S, version, grid, ring),
                  kernel=version, splits=S, options=options)


def megakernel(source, batch: int | None = None, length: int | None = None,
               version: str = "decode_mega_v2", blocks_per_sm: int = 1,
               ring: int = RING, sms: int | None = None) -> "MegaStep":
    """The megakernel step on a ``decoder.KernelGPT`` (``source``), or on a new one built from a
    ``gpt.GPT`` model (``source``) with ``batch`` (default 1) and ``length`` (default the model's
    context); ``ring``: v6, v7's slots of weights; ``sms``: the SMs its grid covers (default
    all of them; fewer leave SMs free for another kernel). Shapes are checked before anything
    touches CUDA."""
    version = version_name(ALL_VERSIONS, version, "decode_mega")
    _check_ring(ring)
    if sms is not None:
        sms = _int(sms, "sms")
        if sms < 1:
            raise LaunchError(f"sms = {sms}: the grid needs at least one SM")
    is_run = hasattr(source, "kc") and hasattr(source, "layers")
    cfg = getattr(source, "cfg", None)
    if cfg is None:
        raise TypeError(f"megakernel: expected a gpt.GPT model or a decoder.KernelGPT, got "
                        f"{type(source).__name__}")
    if is_run:
        for name, given, have in (("batch", batch, source.B), ("length", length, source.L)):
            if given is not None and int(given) != have:
                raise ValueError(f"megakernel: {name} = {given}, but the KernelGPT has {have}")
        batch, length = source.B, source.L
    batch = 1 if batch is None else batch
    length = cfg.ctx if length is None else length
    check_model(cfg, batch, length)
    cb.need_cc(*MIN_CC, what="decode_mega (grid barriers with ld.acquire, 16-byte loads)")
    if not is_run:
        from cudabook import decoder

        source = decoder.KernelGPT(source, batch=batch, length=length)
    return MegaStep(source, version, blocks_per_sm, ring, sms)


class MegaStep:
    """The megakernel on a KernelGPT's buffers (see the module docstring)."""

    def __init__(self, run, version: str, blocks_per_sm: int = 1, ring: int = RING,
                 sms: int | None = None):
        import cupy as cp

        self.run, self.version = run, version_name(ALL_VERSIONS, version, "decode_mega")
        cfg = self.cfg = run.cfg
        B, L, d, H = run.B, run.L, cfg.d, cfg.n_head
        if getattr(run, "temperature", 0.0) > 0:
            raise LaunchError("decode_mega is greedy (the argmax is fused into the LM head): "
                              "sampling with temperature > 0 is not supported")
        self._check_weights()
        have = cb.launch.device().sms
        if sms is not None and not 1 <= sms <= have:
            raise LaunchError(f"sms = {sms}: this GPU has {have} SMs")
        self.launch = config(cfg, B, L, self.version, have if sms is None else sms,
                             blocks_per_sm, ring)
        mod = cb.module("decode_mega", self.launch.options, only=self.version)
        self.kernel = mod.get(self.version)
        shared = self.launch.shared
        static = int(self.kernel.attributes["shared_size_bytes"])
        cb.need_shared(shared + static, f"{self.version} at batch {B}, d {d}")
        if shared + static > 48 * 1024:             # past 48 KiB in all: opt in (the default
            self.kernel.max_dynamic_shared_size_bytes = shared   # leaves 48 KiB - static)
        fit = cb.occupancy.driver_blocks_per_sm(self.kernel, THREADS, shared)
        if fit < blocks_per_sm:
            regs = int(self.kernel.attributes["num_regs"])
            raise LaunchError(f"{self.version}: {blocks_per_sm} blocks per SM asked, {fit} fit "
                              f"({regs} registers x {THREADS} threads, {(shared + static) // 1024}"
                              " KiB of shared memory a block); the grid barrier needs every block"
                              " resident")
        S = self.launch.splits
        grid = self.launch.grid[0]
        f32, h16, u32 = cp.float32, cp.float16, cp.uint32
        self.x = cp.zeros((B, d), f32)
        self.q = cp.zeros((B, H, HEAD_DIM), h16)
        self.a = cp.zeros((B, d), h16)
        self.f = cp.zeros((B, 4 * d), h16)
        self.part = cp.zeros((B * H * S, HEAD_DIM + 2), f32)
        self.cnt = cp.zeros(B * H, u32)
        self.amax_v = cp.zeros((grid, B), f32)
        self.amax_i = cp.zeros((grid, B), cp.int32)
        self.sync = cp.zeros(4, u32)
        ptrs, self.wq = [], None
        if self.version in W4_VERSIONS:       # int4 copies of the weights, built once
            qg = cb.load_launch("qgemv")
            self.wq = [{k: qg.prepare(W[k], bits=4, group=W4_GROUP)
                        for k in ("qkv", "proj", "fc", "fc2")} for W in run.layers]
            self.wq_head = qg.prepare(run.head, bits=4, group=W4_GROUP)
        for i, W in enumerate(run.layers):
            ptrs += [W["ln1"][0], W["ln1"][1], W["ln2"][0], W["ln2"][1]]
            if self.wq is None:
                ptrs += [W["qkv"], W["proj"], W["fc"], W["fc2"]]
            else:
                q = self.wq[i]
                ptrs += [q[k].q for k in ("qkv", "proj", "fc", "fc2")]
                ptrs += [q[k].scales for k in ("qkv", "proj", "fc", "fc2")]
        if self.wq is not None:
            ptrs.append(self.wq_head.scales)
        self.lp = cp.asarray(np.array([cb.describe(p).ptr for p in ptrs], dtype=np.uint64))
        l2 = int(cp.cuda.Device().attributes.get("L2CacheSize", 0))
        self.pf_cap = max(l2 // 4, 1 << 20)
        self.graph = None

    def _check_weights(self) -> None:
        run, cfg = self.run, self.run.cfg
        d, V = cfg.d, cfg.vocab
        named = [("wte", run.wte, (V, d), np.float16), ("head", run.head, (V, d), np.float16),
                 ("ln_f.weight", run.lnf[0], (d,), np.float32),
                 ("ln_f.bias", run.lnf[1], (d,), np.float32)]
        for i, W in enumerate(run.layers):
            named += [(f"blocks.{i}.ln1", W["ln1"][0], (d,), np.float32),
                      (f"blocks.{i}.ln1.bias", W["ln1"][1], (d,), np.float32),
                      (f"blocks.{i}.ln2", W["ln2"][0], (d,), np.float32),
                      (f"blocks.{i}.ln2.bias", W["ln2"][1], (d,), np.float32),
                      (f"blocks.{i}.qkv", W["qkv"], (3 * d, d), np.float16),
                      (f"blocks.{i}.proj", W["proj"], (d, d), np.float16),
                      (f"blocks.{i}.fc", W["fc"], (4 * d, d), np.float16),
                      (f"blocks.{i}.fc2", W["fc2"], (d, 4 * d), np.float16)]
        B, L, H = run.B, run.L, cfg.n_head
        named += [("kc", run.kc, (cfg.n_layer, B, H, L, HEAD_DIM), np.float16),
                  ("vc", run.vc, (cfg.n_layer, B, H, L, HEAD_DIM), np.float16),
                  ("logits", run.logits, (B, V), np.float16), ("tok", run.tok, (B,), np.int32),
                  ("pos", run.pos, (1,), np.int32), ("history", run.history, (B, L + 1), np.int32)]
        for name, a, shape, dt in named:
            cb.expect(a, name, dtype=dt, shape=shape)
            if not cb.expect_aligned(a, name):
                raise LaunchError(f"decode_mega reads {name} 16 bytes at a time: it must start at "
                                  "a 16-byte aligned address")

    # ------------------------------------------------------------------ the step
    def args(self, phases: int = ALL_PHASES) -> tuple:
        run, cfg = self.run, self.cfg
        i32, f32 = np.int32, np.float32
        head = run.head if self.wq is None else self.wq_head.q
        return (self.lp, run.wte, head, run.lnf[0], run.lnf[1], run.kc, run.vc, self.x,
                self.q, self.a, self.f, self.part, self.cnt, self.amax_v, self.amax_i, self.sync,
                run.logits, run.tok, run.pos, run.history, i32(run.history.shape[1]),
                i32(cfg.n_layer), i32(run.L), i32(cfg.vocab), i32(self.launch.splits),
                f32(cfg.eps), f32(math.log2(cfg.rope_base)),
                f32(math.log2(math.e) / math.sqrt(HEAD_DIM)), i32(phases), np.uint64(self.pf_cap))

    def step(self, phases: int = ALL_PHASES) -> None:
        """One decode step in one launch on the current stream (capturable). ``phases`` (a mask
        of PHASES) runs some phases only, every barrier kept: for timing, wrong results; without
        "head" the position does not advance."""
        phases = _int(phases, "phases")
        if not 0 <= phases <= ALL_PHASES:
            raise ValueError(f"phases is a mask of {PHASES}, got {phases}")
        cb.launch.run(self.kernel, self.launch, self.args(phases))

    def errors(self) -> str | None:
        """What the kernel reported (host sync), or None."""
        bits = int(self.sync[2].get())
        if not bits:
            return None
        return "; ".join(m for b, m in ERRORS.items() if bits & b) or f"error bits {bits}"

    def check(self) -> None:
        """Raise cudabook.CheckError naming what the kernel reported, if anything."""
        e = self.errors()
        if e:
            raise cb.CheckError(f"{self.version}: {e} (the steps since did nothing; reset() "
                                "clears the error)")

    def reset(self) -> None:
        """Clear the error word, the barrier's words, the tickets and v5's counts per head
        (after an error only)."""
        self.sync[...] = 0
        self.cnt[...] = 0

    def _room(self, n: int) -> None:
        run = self.run
        if run.host_pos + n > run.L - 1:
            raise ValueError(f"{n} more steps from position {run.host_pos} run past the cache of "
                             f"{run.L} positions")

    def capture(self, phases: int = ALL_PHASES):
        """The step as a CUDA graph (``cudabook.graphs.capture``); its warm-up step is undone
        (tok and pos restored: the first replay writes the same cache row again).

        The device is synchronised first: ``graphs.capture`` runs the warm-up step on a new
        non-blocking stream, which does not wait for work still queued on the current stream.
        Steps launched just before (or a prefill) would otherwise run at the same time as the
        warm-up step: two grids on one barrier word (where two blocks fit an SM both are
        resident, their arrivals mix and a barrier times out) and on the same tok, pos and
        cache."""
        import cupy as cp

        from cudabook import graphs

        self._room(1)
        run = self.run
        tok, pos = run.tok.copy(), run.pos.copy()
        cp.cuda.Device().synchronize()
        g = graphs.capture(lambda: self.step(phases), warmup=1)
        run.tok[...] = tok
        run.pos[...] = pos
        if phases == ALL_PHASES:
            self.graph = g
        return g

    def decode(self, n: int = 1, graph: bool = True) -> None:
        """``n`` steps, replaying the captured graph (captured on first use) or launching."""
        self._room(n)
        if graph and self.graph is None:
            self.capture()
        for _ in range(n):
            self.graph() if graph else self.step()
        self.run.host_pos += n

    def generate(self, prompt, n: int, graph: bool = True):
        """Greedy continuation of ``prompt`` by ``n`` tokens: the book's prefill, then ``n - 1``
        megakernel steps. (ids (B, n) NumPy, logits (n, B, vocab) float32 NumPy)."""
        import cupy as cp

        run = self.run
        logits = [None] * n
        run.prefill(prompt)
        self._room(n - 1)
        logits[0] = run.logits.astype(cp.float32)
        for i in range(1, n):
            self.decode(1, graph)
            logits[i] = run.logits.astype(cp.float32)
        T = run.host_pos - n + 1
        return cp.asnumpy(run.history[:, T:T + n]), cp.asnumpy(cp.stack(logits))

    def step_us(self, ids, n: int = 100) -> float:
        """Microseconds per token of the step's CUDA graph replayed ``n`` times back to back
        after the book's prefill of ``ids`` (B, T), from position T each time
        (``decoder.timed_step``, as the book's step and PyTorch's are timed): the error word
        cleared first, then it and the greedy token (the largest logit's) checked before and
        after timing (``CheckError``)."""
        from cudabook import decoder

        run = self.run
        self.reset()                                # an earlier failure is not this timing's
        run.prefill(ids)
        self._room(n + 3)
        g = self.capture()
        T, tok = run.host_pos, run.tok.copy()

        def reset() -> None:
            run.pos[...] = T
            run.tok[...] = tok

        def check(when: str) -> None:
            self.check()
            decoder.check_next_token(run.logits, run.tok, f"{self.version} {when}")

        return decoder.timed_step(g, reset, check, n)

    def phase_times(self, repeat: int = 50) -> dict[str, float]:
        """Microseconds per step of: the whole step, the barriers alone (no phase), and each
        phase alone with every barrier (its cost = that minus the barriers). Each captured as a
        graph and replayed ``repeat`` times between CUDA events; pos, tok, history and the
        residual are restored after each (the cache keeps what the replays wrote). In v3-v5 the
        attention combine runs in the proj phase (its prologue), so "proj" includes it. v5 has 4
        barriers a layer (no barrier after QKV), so its "barriers only" counts 4 a layer, and
        its attention waits for the heads' counts only when QKV runs too: "attention" alone
        leaves the wait out, the whole step has it."""

        run = self.run
        self._room(repeat + 2)
        saved = [a.copy() for a in (run.pos, run.tok, run.history, self.x)]
        masks = {"step": ALL_PHASES, "barriers only": 0, **PHASES}
        out = {}
        for name, mask in masks.items():
            out[name] = self.capture(mask).replay_us(repeat)
            for a, b in zip((run.pos, run.tok, run.history, self.x), saved):
                a[...] = b
        self.check()
        return out


# ----------------------------------------------------------------------------- checks
def reference_logits(model, prompt, feed, length: int | None = None) -> np.ndarray:
    """Logits (n, B, vocab) float64 of ``model``'s own forward with a KV cache (pass a float64
    copy for a float64 reference): the prompt (B, T) from position 0 (None or T = 0: none),
    then feed[:, i] (B, n) at position T + i, one step each."""
    import torch

    from cudabook import gpt

    p = next(model.parameters())
    feed = np.asarray(feed, dtype=np.int64)
    B = feed.shape[0]
    T = 0 if prompt is None else int(np.asarray(prompt).shape[-1])
    cache = gpt.KVCache(model.cfg, B, p.device, p.dtype, length or model.cfg.ctx)
    out = []
    with torch.no_grad():
        if T:
            model(torch.as_tensor(np.asarray(prompt).reshape(B, T), device=p.device), cache, 0)
        for i in range(feed.shape[1]):
            t = torch.as_tensor(feed[:, i:i + 1], device=p.device)
            out.append(model(t, cache, T + i, check=False)[:, -1].double().cpu().numpy())
    return np.stack(out)


def compare(mk: MegaStep, book, model64, prompt=None, steps: int = 3, start: int = 0) -> dict:
    """``steps`` decode steps of the megakernel ``mk`` and of the book's step ``book`` (a
    KernelGPT of the same weights, batch and length), each fed the megakernel's tokens, against
    ``reference_logits`` of ``model64``. After the prompt (B, T) (the book's prefill on both), or
    with no prompt from position 0 with token ``start``. Returns the positions decoded and the
    largest |logit difference| mega-book, mega-ref, book-ref, and each engine's largest
    difference from the reference over the tolerance of ``decoder.compare_static``
    (4 (n_layer + 1) u rms(ref) + u |ref|, u = 2^-11)."""
    import cupy as cp

    run = mk.run
    B = run.B
    if prompt is None:
        for r in (run, book):
            r.tok[...] = int(start)
            r.pos[...] = 0
            r.host_pos = 0
    else:
        prompt = np.asarray(prompt).reshape(B, -1)
        run.prefill(prompt)
        book.prefill(prompt)
    got, want, feed, positions = [], [], [], []
    for _ in range(steps):
        mk._room(1)
        book.tok[...] = run.tok
        book.pos[...] = run.pos
        positions.append(run.host_pos)
        feed.append(cp.asnumpy(run.tok))
        mk.step()
        book.step()
        got.append(cp.asnumpy(run.logits).astype(np.float64))
        want.append(cp.asnumpy(book.logits).astype(np.float64))
        run.host_pos += 1
        book.host_pos += 1
    mk.check()
    ref = reference_logits(model64, prompt, np.stack(feed, 1), run.L)
    got, want = np.stack(got), np.stack(want)
    u = 2.0 ** -11
    tol = 4 * (mk.cfg.n_layer + 1) * u * np.sqrt((ref ** 2).mean(-1, keepdims=True)) + \
        u * np.abs(ref)
    return {"positions": positions,
            "mega_vs_book": float(np.abs(got - want).max()),
            "mega_vs_ref": float(np.abs(got - ref).max()),
            "book_vs_ref": float(np.abs(want - ref).max()),
            "mega_tol_ratio": float((np.abs(got - ref) / tol).max()),
            "book_tol_ratio": float((np.abs(want - ref) / tol).max()),
            "tokens_equal_ref": bool((got.argmax(-1) == ref.argmax(-1)).all())}


def dequantized_model(model, mk: MegaStep, dtype=None):
    """A copy of ``model`` (the GPT the KernelGPT of ``mk`` was built from) whose QKV, proj, fc,
    fc2 and LM head weights are v8's int4 weights dequantized (q x scale, exact in float32 and
    float64), in ``dtype`` (default float64): the reference of decode_mega_v8's step."""
    import copy

    import torch

    if mk.wq is None:
        raise ValueError(f"dequantized_model: {mk.version} keeps fp16 weights (only "
                         f"{', '.join(W4_VERSIONS)} quantizes them)")
    m = copy.deepcopy(model).to(dtype or torch.float64)
    with torch.no_grad():
        for blk, q in zip(m.blocks, mk.wq):
            for k in ("qkv", "proj", "fc", "fc2"):
                w = getattr(blk, k).weight
                w.copy_(torch.from_dlpack(q[k].dequantized()).to(w.dtype).view_as(w))
        m.head.weight.copy_(torch.from_dlpack(mk.wq_head.dequantized()).to(m.head.weight.dtype)
                            .view_as(m.head.weight))
    return m


def greedy_agreement(mk: MegaStep, book, prompt, n: int = 32) -> dict:
    """Greedy continuations of ``prompt`` by ``n`` tokens from the megakernel (its graph) and
    from the book's engine (its graph). Where they part, the book's top-2 logit gap at that
    step says whether it was a near tie (fp16 logits one or two ulps apart)."""
    ids_m, _ = mk.generate(prompt, n)
    ids_b, lg_b = book.generate(prompt, n)
    same = bool((ids_m == ids_b).all())
    first = gap = None
    if not same:
        first = int(np.flatnonzero((ids_m != ids_b).any(0))[0])
        top = np.sort(lg_b[first], -1)[:, -2:]
        gap = float((top[:, 1] - top[:, 0]).min())
    mk.check()
    return {"same": same, "first_difference": first, "book_top2_gap": gap,
            "mega": ids_m.tolist(), "book": ids_b.tolist()}


def sanitize_targets():
    """Two steps of the tiny GPT's shapes at batch 2 (every phase, the tickets, the barriers)
    after a 5-token prefill, in v2, v5 (v3's attention, v4's splits and combine, v5's counts)
    v6 (the weight ring's cp.async copies into shared memory), v7 (on sm_90 the ring's bulk
    copies and mbarriers) and v8 (int4 weights and their scales)."""
    import torch

    from cudabook import gpt

    model = gpt.build(gpt.TINY, 0, "cuda", torch.float16)
    for version in ("decode_mega_v2", "decode_mega_v5", "decode_mega_v6", "decode_mega_v7",
                    "decode_mega_v8"):
        mk = megakernel(model, batch=2, length=64, version=version)
        mk.run.prefill(np.arange(10, dtype=np.int64).reshape(2, 5))

        def two_steps(mk=mk) -> None:
            mk.run.pos[...] = 5                 # the same positions at every call
            mk.step()
            mk.step()

        yield f"{version} (tiny GPT, batch 2, 2 steps)", two_steps
