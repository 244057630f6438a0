"""The paged KV cache (capstone): the host bookkeeping (cudabook.paging) on the CPU, the Numba
twins of paged decode attention on the simulator (or a GPU), and the CUDA C++ kernels (GPU),
each against a float64 dense reference; lengths at and past block boundaries, shuffled blocks,
grouped-query heads, several splits, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest

import cudabook as cb
from cudabook.paging import BlockAllocator, PagedTable, PoolExhausted

gpu = pytest.mark.gpu
pa = cb.load_launch("paged_attention")


# ----------------------------------------------------------------------------- bookkeeping
def test_allocator_hands_out_each_block_once_and_refuses_double_free():
    a = BlockAllocator(8, 16)
    x, y = a.allocate(3), a.allocate(5)
    assert sorted(x + y) == list(range(8)) and a.free == 0
    with pytest.raises(PoolExhausted, match="1 blocks asked, 0 of 8 free"):
        a.allocate(1)
    a.release(x)
    assert a.free == 3 and sorted(a.allocate(3)) == sorted(x)
    a.release(y)
    with pytest.raises(ValueError, match="double free"):
        a.release(y[:1])
    assert a.blocks_for(16) == 1 and a.blocks_for(17) == 2


def test_table_grows_a_block_at_each_boundary_and_reuses_retired_blocks():
    t = PagedTable(BlockAllocator(6, 4), max_requests=2, max_blocks=3)
    s0 = t.admit(4)                               # one full block
    assert t.seq_lens[s0] == 4 and (t.block_table[s0] >= 0).sum() == 1
    assert t.grow(s0) == 4 and (t.block_table[s0] >= 0).sum() == 2     # position 4: a new block
    for _ in range(3):
        t.grow(s0)
    assert t.seq_lens[s0] == 8 and (t.block_table[s0] >= 0).sum() == 2
    s1 = t.admit(9)                               # 3 blocks
    assert s1 != s0 and t.alloc.free == 1
    assert not t.fits(1)                          # both slots in use
    pos = t.positions(s1)
    assert pos.shape == (9, 2) and (pos[:, 1] == np.arange(9) % 4).all()
    used = set(t.block_table[s0][t.block_table[s0] >= 0]) | set(t.block_table[s1][:3])
    assert len(used) == 5                         # nobody shares a block
    t.retire(s0)
    assert t.alloc.free == 3 and not t.in_use[s0]
    s2 = t.admit(12)
    assert s2 == s0 and t.alloc.free == 0
    with pytest.raises(ValueError, match="full"):
        for _ in range(1):
            t.grow(s2)                            # 12 = 3 blocks of 4: the table's row is full


def test_table_refuses_what_cannot_be_served():
    t = PagedTable(BlockAllocator(4, 16), max_requests=3, max_blocks=2)
    with pytest.raises(ValueError, match="empty prompt"):
        t.admit(0)
    with pytest.raises(ValueError, match="longer than the cache holds per request"):
        t.admit(33)
    t.admit(32)
    t.admit(17)
    assert not t.fits(1)
    with pytest.raises(PoolExhausted, match="1 blocks asked, 0 of 4 free"):
        t.admit(1)
    assert not t.in_use[2] and (t.block_table[2] == -1).all()     # nothing changed
    with pytest.raises(ValueError, match="holds no request"):
        t.retire(2)


# ----------------------------------------------------------------------------- attention
def _paged_case(lens, H, Hkv, D, BS, MB, NB, seed=0, dtype=np.float16):
    """A pool filled with noise, each request's blocks drawn at random from it (not in order)."""
    rng = np.random.default_rng(seed)
    B = len(lens)
    table = np.full((B, MB), -1, np.int32)
    ids = rng.permutation(NB)
    for b, n in enumerate(lens):
        k = -(-n // BS)
        table[b, :k], ids = ids[:k], ids[k:]
    q = rng.standard_normal((B, H, D)).astype(dtype)
    kp = rng.standard_normal((NB, Hkv, BS, D)).astype(dtype)
    vp = rng.standard_normal((NB, Hkv, BS, D)).astype(dtype)
    return q, kp, vp, table, np.array(lens, np.int32)


def test_reference_through_the_table_is_dense_attention():
    q, kp, vp, table, lens = _paged_case([5, 16, 17], H=4, Hkv=2, D=8, BS=4, MB=5, NB=20,
                                         dtype=np.float64)
    out = pa.reference(q, kp, vp, table, lens)
    b, h, n = 2, 3, 17                            # request 2, query head 3 -> KV head 1
    K = np.concatenate([kp[table[b, i], 1] for i in range(5)])[:n]
    V = np.concatenate([vp[table[b, i], 1] for i in range(5)])[:n]
    s = K @ q[b, h] / np.sqrt(8)
    p = np.exp(s - s.max())
    assert np.allclose(out[b, h], p @ V / p.sum(), atol=1e-12)


@pytest.mark.parametrize("lens, H, Hkv, splits", [([1, 4, 5, 12], 4, 2, 2), ([9, 3], 2, 2, 3),
                                                  ([16], 8, 1, 1)])
def test_numba_twins_match_the_reference(lens, H, Hkv, splits):
    q, kp, vp, table, sl = _paged_case(lens, H=H, Hkv=Hkv, D=8, BS=4, MB=4, NB=16, seed=len(lens),
                                       dtype=np.float32)
    out, m, l_, o = pa.decode_numba(q, kp, vp, table, sl, splits=splits)
    cb.check(out, pa.reference(q, kp, vp, table, sl), atol=1e-5, rtol=1e-5)
    S, bps = pa.plan(len(lens), Hkv, 4, 4, splits)
    assert m.shape[2] == S
    for b, n in enumerate(sl):                    # a split past a request's end is empty
        for s in range(S):
            empty = s * bps * 4 >= n
            assert (m[b, :, s] == -np.inf).all() == empty and (l_[b, :, s] == 0).all() == empty
    assert np.isfinite(out).all()


def test_numba_twin_gives_nan_for_a_bad_block_id_or_length():
    q, kp, vp, table, sl = _paged_case([5, 6], H=2, Hkv=1, D=8, BS=4, MB=2, NB=8,
                                       dtype=np.float32)
    table[1, 1] = 99                              # outside the pool
    out = pa.decode_numba(q, kp, vp, table, sl, splits=2)[0]
    assert np.isfinite(out[0]).all() and np.isnan(out[1]).all()
    sl[0] = 9                                     # longer than its 2 blocks of 4
    out = pa.decode_numba(q, kp, vp, table, sl, splits=1)[0]
    assert np.isnan(out[0]).all()


def test_plan_and_checks_refuse_bad_input():
    assert pa.plan(1, 2, 8, 16, splits=4) == (4, 2)
    assert pa.plan(1, 2, 64, 16, splits=1) == (2, 32)      # 1024 keys: two splits of 512
    with pytest.raises(ValueError, match="positive int"):
        pa.plan(1, 2, 8, 16, splits=0)
    q, kp, vp, table, sl = _paged_case([5, 6], H=6, Hkv=4, D=8, BS=4, MB=2, NB=8)
    with pytest.raises(cb.LaunchError, match="multiple of Hkv"):
        pa.decode_numba(q, kp, vp, table, sl)
    q, kp, vp, table, sl = _paged_case([5, 6], H=4, Hkv=2, D=8, BS=4, MB=2, NB=8)
    for bad_sl, msg in (([0, 6], "request 0: 0 tokens"), ([5, 9], "request 1: 9 tokens")):
        with pytest.raises(ValueError, match=msg):
            pa.check_table(table, np.array(bad_sl, np.int32), 8, 4)
    t2 = table.copy()
    t2[1, 0] = t2[0, 0]
    with pytest.raises(ValueError, match="used by two positions"):
        pa.check_table(t2, sl, 8, 4)
    t2[1, 0] = 8
    with pytest.raises(ValueError, match="outside the pool"):
        pa.check_table(t2, sl, 8, 4)


@gpu
@pytest.mark.parametrize("lens, H, Hkv, D, splits", [([1, 16, 17, 100], 8, 2, 64, 3),
                                                     ([255, 256, 257], 4, 4, 128, None),
                                                     ([33], 8, 1, 128, 1),
                                                     ([7, 64], 32, 8, 64, 2)])
@pytest.mark.parametrize("version", pa.VERSIONS)
def test_cuda_paged_decode_matches_the_reference(lens, H, Hkv, D, splits, version):
    import cupy as cp

    q, kp, vp, table, sl = _paged_case(lens, H, Hkv, D, BS=16, MB=17, NB=80, seed=D + H)
    args = [cp.asarray(a) for a in (q, kp, vp, table, sl)]
    out = pa.decode(*args, splits=splits, check=True, version=version)
    cb.check(out, pa.reference(q, kp, vp, table, sl), atol=2e-3, rtol=2e-3)


@gpu
def test_cuda_append_then_decode_sees_the_new_token_and_bad_ids_give_nan():
    import cupy as cp

    q, kp, vp, table, sl = _paged_case([16, 5], H=4, Hkv=2, D=64, BS=16, MB=3, NB=8, seed=3)
    spare = min(set(range(8)) - {int(table[0, 0]), int(table[1, 0])})
    table[0, 1] = spare                           # request 0 grows into a second block
    sl = sl + 1
    rng = np.random.default_rng(4)
    k1, v1 = (rng.standard_normal((2, 2, 64)).astype(np.float16) for _ in range(2))
    g = [cp.asarray(a) for a in (q, kp, vp, table, sl)]
    pa.append(cp.asarray(k1), cp.asarray(v1), g[1], g[2], g[3], g[4])
    kp[spare, :, 0], kp[table[1, 0], :, 5] = k1[0], k1[1]      # position 16 and position 5
    vp[spare, :, 0], vp[table[1, 0], :, 5] = v1[0], v1[1]
    cb.check(g[1], kp, atol=0, rtol=0)
    cb.check(pa.decode(*g), pa.reference(q, kp, vp, table, sl), atol=2e-3, rtol=2e-3)
    g[3][1, 0] = 99                               # a bad block id: NaN for that request only
    for v in pa.VERSIONS:
        out = pa.decode(*g, version=v).get()
        assert np.isfinite(out[0]).all() and np.isnan(out[1]).all(), v


@gpu
def test_cuda_paged_decode_refuses_bad_input():
    import cupy as cp

    q, kp, vp, table, sl = (cp.asarray(a) for a in _paged_case([5], 4, 2, 48, 16, 2, 4))
    with pytest.raises(cb.LaunchError, match="head dimension 48"):
        pa.decode(q, kp, vp, table, sl)
    q, kp, vp, table, sl = (cp.asarray(a) for a in _paged_case([5], 4, 2, 64, 16, 2, 4))
    with pytest.raises(TypeError, match="float16"):
        pa.decode(q.astype(cp.float32), kp, vp, table, sl)
    with pytest.raises(ValueError, match="work: made for"):
        pa.decode(q, kp, vp, table, sl, work=pa.Workspace(1, 8, 64, 1))


# ----------------------------------------------------------------------------- batching
def _next_token(tokens, vocab=50):
    """A stand-in model: the next token is a function of the whole sequence read back."""
    t = np.asarray(tokens, np.int64)
    return int((t * np.arange(1, t.size + 1)).sum() * 31 + t.size) % vocab


def _solo(req):
    seq, out = list(req.prompt), []
    while len(out) < req.max_new_tokens:
        out.append(_next_token(seq))
        seq.append(out[-1])
    return out


def _serve(requests, table):
    """Continuous batching with the stand-in model reading every sequence back through the
    block table from a pool of token ids (a mix-up of blocks changes the tokens)."""
    from cudabook.batching import ContinuousBatcher

    bs = table.alloc.block_size
    pool = np.full((table.alloc.num_blocks, bs), -1, np.int64)
    cbat = ContinuousBatcher(table)
    for r in requests:
        cbat.submit(r)
    rows, width = 0, 0
    while not cbat.idle:
        for slot, req in cbat.admit():
            blk, off = table.positions(slot).T
            pool[blk, off] = req.prompt
            cbat.commit(slot, _next_token(pool[blk, off]))
        slots = cbat.decoding()
        rows, width = rows + len(slots), max(width, len(slots))
        for s in slots:
            req = cbat.running[s]
            blk, off = table.positions(s).T
            pool[blk[-1], off[-1]] = req.out[-1]              # the input token's K/V
            cbat.commit(s, _next_token(pool[blk, off]))
    return cbat, rows, width


def test_continuous_batching_gives_every_request_its_solo_tokens_and_frees_everything():
    from cudabook.batching import Request, static_batches

    rng = np.random.default_rng(7)
    reqs = [Request(i, rng.integers(0, 50, rng.integers(1, 40)), int(rng.integers(1, 61)))
            for i in range(24)]
    table = PagedTable(BlockAllocator(40, 8), max_requests=6, max_blocks=13)
    cbat, rows, width = _serve(reqs, table)
    assert cbat.results == {r.id: _solo(Request(r.id, r.prompt, r.max_new_tokens))
                            for r in reqs}
    assert table.alloc.free == 40 and not table.in_use.any() and width <= 6
    assert rows == sum(r.max_new_tokens - 1 for r in reqs)      # no padded rows
    static = static_batches(reqs, 6)
    assert sum(b["rows"] for b in static) > rows                 # padding: finished rows ride on
    assert cbat.steps < sum(b["steps"] for b in static) + len(static)


def test_admission_waits_for_memory_and_never_overtakes():
    from cudabook.batching import ContinuousBatcher, Request

    table = PagedTable(BlockAllocator(4, 4), max_requests=4, max_blocks=4)
    cbat = ContinuousBatcher(table)
    cbat.submit(Request("big", [1] * 9, 8))                      # 16 positions: all 4 blocks
    cbat.submit(Request("small", [1], 1))
    assert [r.id for _, r in cbat.admit()] == ["big"]
    assert cbat.admit() == []                                    # promised blocks count as used
    with pytest.raises(ValueError, match="submitted twice"):
        cbat.submit(Request("small", [2], 1))
    with pytest.raises(ValueError, match="more than a request can hold"):
        cbat.submit(Request("huge", [1] * 10, 8))
    with pytest.raises(ValueError, match="empty prompt"):
        Request("e", [], 3)


# ----------------------------------------------------------------------------- ex12.1 grader
# The right merge and the mistakes a first merge makes, written as a reader would write them.
# (The chapter's solutions notebook does not exist yet; these stand in for its reference.)
_MERGE = '''
import math
from numba import cuda


@cuda.jit
def merge(m, l, o, out):
    h, b = cuda.blockIdx.x, cuda.blockIdx.y
    S, D = m.shape[2], out.shape[2]
    M = {start}
    for s in range(S):
        M = max(M, m[b, h, s])
    den = 0.0
    for s in range(S):
        den += {weight} * l[b, h, s]
    for d in range({d_range}):
        num = 0.0
        for s in range(S):
            num += {weight} * o[b, h, s, d]
        out[b, h, d] = num / den
'''
_RIGHT = dict(start="-math.inf", weight="math.exp(m[b, h, s] - M)",
              d_range="cuda.threadIdx.x, D, cuda.blockDim.x")


def _answer(template: str, right: dict, name: str, **edit):
    """The kernel ``name`` of ``template`` filled with ``right`` and ``edit``, its text
    registered with linecache (as a notebook cell's is) so that the grader can read its source."""
    import linecache

    text = template.format(**{**right, **edit})
    fname = f"<answer {abs(hash(text))}>"
    linecache.cache[fname] = (len(text), None, text.splitlines(keepends=True), fname)
    ns = {}
    exec(compile(text, fname, "exec"), ns)
    return ns[name]


def _merge_kernel(**edit):
    return _answer(_MERGE, _RIGHT, "merge", **edit)


def test_ex12_1_passes_the_right_merge(capsys):
    from cudabook.graders import ex12_1

    ex12_1(_merge_kernel())
    assert capsys.readouterr().out.strip() == "PASS ex12.1"


@pytest.mark.parametrize("edit, expect", [
    (dict(weight="1.0"), "rescale both by exp"),                              # not rescaled
    (dict(start="0.0"), "start the running maximum at -inf"),                 # M from 0
    (dict(d_range="cuda.threadIdx.x, min(D, 32)"), "loop d over range"),      # 32 columns only
    (dict(weight="(1.0 if l[b, h, s] > 0 else 0.0) / max(l[b, h, s], 1e-30)"),
     "averaging each split's normalised output"),         # each split normalised, then averaged
])
def test_ex12_1_rejects_the_mistakes_of_a_first_merge(edit, expect):
    from cudabook.graders import GradeError, ex12_1

    with pytest.raises(GradeError, match=expect):
        ex12_1(_merge_kernel(**edit))


def test_ex12_1_refuses_the_book_kernel_and_a_plain_function():
    from cudabook.graders import GradeError, ex12_1

    with pytest.raises(GradeError, match="book's own kernel"):
        ex12_1(cb.load_numba("paged_attention").paged_merge)
    with pytest.raises(GradeError, match="expected a @cuda.jit kernel"):
        ex12_1(lambda m, l, o, out: None)


# ----------------------------------------------------------------------------- ex12.2 grader
_SCORES = '''
import math
from numba import cuda


@cuda.jit
def scores_k(q, k_pool, block_table, seq_lens, scores):
    t = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    b = cuda.blockIdx.y
    BS, D = k_pool.shape[1], q.shape[1]
    if {guard}:
        return
    if t >= seq_lens[b]:
        {mask}
        return
    blk = block_table[{row}, {blk}]
    acc = 0.0
    for e in range(D):
        acc += q[b, e] * k_pool[blk, t % BS, e]
    scores[b, t] = acc{scale}
'''
_SCORES_RIGHT = dict(guard="t >= scores.shape[1]", mask="scores[b, t] = -math.inf", row="b",
                     blk="t // BS", scale=" / math.sqrt(D)")


def _scores_kernel(**edit):
    return _answer(_SCORES, _SCORES_RIGHT, "scores_k", **edit)


def test_ex12_2_passes_the_right_kernel(capsys):
    from cudabook.graders import ex12_2

    ex12_2(_scores_kernel())
    assert capsys.readouterr().out.strip() == "PASS ex12.2"


@pytest.mark.parametrize("edit, expect", [
    (dict(blk="(t + 1) // BS"), "off by one reads the wrong block exactly at a block boundary"),
    (dict(row="0"), "row b of the block table"),
    (dict(mask="pass"), "a position past the end is -inf"),
    (dict(guard="False"), "bounds guard|index out of range|past the end"),
    (dict(scale=""), "the scale 1 / sqrt"),
])
def test_ex12_2_rejects_the_mistakes_of_a_first_paged_read(edit, expect):
    from cudabook.graders import GradeError, ex12_2

    with pytest.raises(GradeError, match=expect):
        ex12_2(_scores_kernel(**edit))


# ----------------------------------------------------------------------------- the solutions
# The answers of solutions/12_serving.ipynb, read from the notebook (tests/solution_cells.py),
# never pasted: they pass their graders, their stubs (what exercises/12_serving.ipynb holds)
# fail, edits of them that make a first answer's mistakes get that mistake's hint, and the page
# states the stubs' sizes and has two levels of hints per exercise.
_SOLVED = [("ex12.1", "merge_splits"), ("ex12.2", "paged_scores")]


def _solution():
    from solution_cells import Solution

    return Solution("12")


def _grader(ex: str):
    from cudabook import graders

    return getattr(graders, ex.replace(".", "_"))


@pytest.mark.parametrize("ex, name", _SOLVED)
def test_solutions_notebook_answer_passes(ex, name, capsys):
    _grader(ex)(_solution().get(ex, name))
    assert capsys.readouterr().out == f"PASS {ex}\n"


@pytest.mark.parametrize("ex, name", _SOLVED)
def test_solutions_notebook_stub_fails(ex, name):
    from cudabook.graders import GradeError

    with pytest.raises(GradeError, match=f"{ex}: not implemented yet"):
        _grader(ex)(_solution().stub(ex, name))


@pytest.mark.parametrize("ex, name, edits, expect", [
    # the splits added without rescaling to the common maximum
    ("ex12.1", "merge_splits", [("math.exp(m[b, h, s] - M) * ", "", 2)], "rescale both by exp"),
    ("ex12.1", "merge_splits", [("M = -math.inf", "M = 0.0")], "start the running maximum at -inf"),
    ("ex12.2", "paged_scores", [("block_table[b, t // BS]", "block_table[b, (t + 1) // BS]")],
     "off by one reads the wrong block exactly at a block boundary"),
    ("ex12.2", "paged_scores", [("        scores[b, t] = -math.inf\n", "")],
     "a position past the end is -inf"),
], ids=["not-rescaled", "max-from-zero", "block-off-by-one", "no-mask"])
def test_solutions_notebook_edited_answers_get_their_hint(ex, name, edits, expect):
    from cudabook.graders import GradeError

    with pytest.raises(GradeError, match=expect):
        _grader(ex)(_solution().get(ex, name, edits=edits))


@pytest.mark.parametrize("ex", [ex for ex, _ in _SOLVED])
def test_exercise_page_states_its_stub_sizes_and_has_two_hints(ex):
    from solution_cells import check_exercise_page

    check_exercise_page("12", ex)


# ----------------------------------------------------------------------------- ex12.3, ex12.4
# The CUDA C++ exercises: the right answers as a reader would write them, with the solution
# regions marked as solutions/12_serving.ipynb will mark them (the stub is what
# tools/nbtools.py makes of them); a wrong answer is the right one with an edit, each `old`
# checked to occur exactly `count` times. (The notebook's cells do not exist yet; once they do,
# these templates give way to Solution("12").get("ex12.3", "paged_merge_src", edits=...).)
_MERGE_CUDA = r'''
#include <cuda_fp16.h>
#define NEG_INF __int_as_float(0xff800000)        // -infinity (NVRTC has no INFINITY)

// m, l: (B, H, S) float32, each split's maximum score and its sum of e^(s - m); o: (B, H, S, D)
// float32, each split's sum of e^(s_j - m) v_j; out: (B, H, D) fp16. An empty split is
// (-inf, 0, 0). grid (H, B), block 32: block (h, b) merges head h of request b.
extern "C" __global__ void paged_merge(const float* m, const float* l, const float* o,
                                       __half* out, int H, int D, int S) {
    const int h = blockIdx.x, b = blockIdx.y;
    const long long head = ((long long)b * H + h) * S;     // (b, h, split 0) in m and l
    // BEGIN SOLUTION ex12.3
    float M = NEG_INF;                         // the largest maximum over the splits
    for (int s = 0; s < S; ++s) M = fmaxf(M, m[head + s]);
    float den = 0.0f;                          // sum_s e^(m_s - M) l_s: an empty split adds 0
    for (int s = 0; s < S; ++s) den += expf(m[head + s] - M) * l[head + s];
    for (int d = threadIdx.x; d < D; d += blockDim.x) {    // the threads share the columns
        float num = 0.0f;
        for (int s = 0; s < S; ++s) num += expf(m[head + s] - M) * o[(head + s) * D + d];
        out[((long long)b * H + h) * D + d] = __float2half(num / den);
    }
    // END SOLUTION
}
'''

_SCORES_CUDA = r'''
#include <cuda_fp16.h>
#define NEG_INF __int_as_float(0xff800000)        // -infinity (NVRTC has no INFINITY)

// q: (B, D) fp16, one query per request; k_pool: (NB, BS, D) fp16, the pool of key blocks;
// block_table: (B, MB) int32, -1 past a request's blocks; seq_lens: (B,) int32; scores: (B, T)
// float32, T = MB * BS. grid (ceil(T / 32), B), block 32: a thread per (position, request).
extern "C" __global__ void paged_scores(const __half* q, const __half* k_pool,
                                        const int* block_table, const int* seq_lens,
                                        float* scores, int B, int MB, int BS, int D, int T) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;     // position
    const int b = blockIdx.y;                                 // request
    // BEGIN SOLUTION ex12.4
    if (t >= T) return;                        // the grid rounds T up to whole blocks of 32
    if (t >= seq_lens[b]) {                    // past the request's end: masked
        scores[(long long)b * T + t] = NEG_INF;
        return;
    }
    const int blk = block_table[b * MB + t / BS];            // logical block t / BS -> physical
    const __half* k = k_pool + ((long long)blk * BS + t % BS) * D;
    const __half* qb = q + (long long)b * D;
    float acc = 0.0f;
    for (int e = 0; e < D; ++e) acc += __half2float(qb[e]) * __half2float(k[e]);
    scores[(long long)b * T + t] = acc / sqrtf((float)D);
    // END SOLUTION
}
'''

# a right answer that stages q in shared memory (the barrier before any thread returns): the
# graders run compute-sanitizer on it
_SCORES_SHARED = [
    ("    // BEGIN SOLUTION ex12.4\n",
     "    // BEGIN SOLUTION ex12.4\n    __shared__ float qs[128];\n"
     "    for (int e = threadIdx.x; e < D; e += blockDim.x) qs[e] = __half2float(q[(long long)b"
     " * D + e]);\n    __syncthreads();\n"),
    ("    const __half* qb = q + (long long)b * D;\n", ""),
    ("acc += __half2float(qb[e]) * __half2float(k[e]);", "acc += qs[e] * __half2float(k[e]);"),
]

_MERGE_WRONG = [
    # the splits added without rescaling to the common maximum
    ([("expf(m[head + s] - M) * ", "", 2)], "rescale both by exp"),
    ([("float M = NEG_INF;", "float M = 0.0f;")], "start the running maximum at -infinity"),
    ([("for (int d = threadIdx.x; d < D;", "for (int d = threadIdx.x; d < min(D, 32);")],
     "loop for \\(int d = threadIdx.x; d < D; d \\+= blockDim.x\\)"),
    # each split normalised by its own l, the results averaged
    ([("expf(m[head + s] - M) * l[head + s]", "(l[head + s] > 0.0f ? 1.0f : 0.0f)"),
      ("expf(m[head + s] - M) * o[", "(l[head + s] > 0.0f ? 1.0f / l[head + s] : 0.0f) * o[")],
     "averaging each split's normalised output"),
    # the book's kernels' base-2 weights (their scores are in the log2 domain; these are not)
    ([("expf(", "exp2f(", 2)], "powers of 2"),
    ([("d < D; d += blockDim.x", "d <= D; d += blockDim.x")], "wrote past the end of out"),
]

_SCORES_WRONG = [
    ([("t / BS]", "(t + 1) / BS]")],
     "off by one reads the wrong block exactly at a block boundary"),
    ([("block_table[b * MB", "block_table[0 * MB")], "row b of the block table"),
    # no mask: every position reads the table, -1 past the request's blocks (zeros here)
    ([("    if (t >= seq_lens[b]) {                    // past the request's end: masked\n"
       "        scores[(long long)b * T + t] = NEG_INF;\n        return;\n    }\n", "")],
     "a position past the end is -inf"),
    ([("    if (t >= T) return;", "")], "wrote past the end of scores: a guard on t < T"),
    ([(" / sqrtf((float)D)", "")], "not multiplied by the scale 1 / sqrt"),
    # the dot product accumulated in half precision
    ([("float acc = 0.0f;", "__half acc = __float2half(0.0f);"),
      ("acc += __half2float(qb[e]) * __half2float(k[e]);", "acc = __hfma(qb[e], k[e], acc);"),
      ("acc / sqrtf", "__half2float(acc) / sqrtf")], "half-precision arithmetic"),
]


def _cuda_src(template: str, *edits) -> str:
    """``template`` with ``edits`` (old, new[, count]) applied, each checked to apply."""
    text = template
    for e in edits:
        old, new, count = (*e, 1) if len(e) == 2 else e
        assert text.count(old) == count, f"edit {old!r}: found {text.count(old)}, want {count}"
        text = text.replace(old, new)
    return text


def _stub(template: str) -> str:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from nbtools import strip_solutions

    return strip_solutions(template)


_CUDA = {"ex12.3": _MERGE_CUDA, "ex12.4": _SCORES_CUDA}
_CUDA_KERNEL = {"ex12.3": "paged_merge", "ex12.4": "paged_scores"}


@pytest.mark.parametrize("ex", sorted(_CUDA))
def test_cuda_exercise_stub_is_refused_on_any_machine(ex):
    from cudabook.graders import GradeError

    stub = _stub(_CUDA[ex])
    assert f"// TODO {ex} (roughly" in stub
    with pytest.raises(GradeError, match=f"{ex}: not implemented yet"):
        _grader(ex)(stub)


def _book_merge_renamed() -> str:
    """kernels/paged_attention.cu's paged_merge_v1 pasted in as the answer, renamed."""
    body = cb.kernel_source("paged_attention.cu", "paged_merge_v1")
    return "#include <cuda_fp16.h>\n" + body.replace("paged_merge_v1", "paged_merge")


@pytest.mark.parametrize("ex, src, expect", [
    ("ex12.3", _cuda_src(_MERGE_CUDA, ("#include <cuda_fp16.h>",
                                       "#include <cuda_fp16.h>\n#include <cub/cub.cuh>")),
     r"includes <cub/cub\.cuh>, a library"),
    ("ex12.4", _cuda_src(_SCORES_CUDA, ("#include <cuda_fp16.h>",
                                        "#include <cuda_fp16.h>\n#include <thrust/reduce.h>")),
     r"includes <thrust/reduce\.h>, a library"),
    ("ex12.4", _cuda_src(_SCORES_CUDA, ("float acc = 0.0f;", "float acc = cub::Sum()(0.f, 0.f);")),
     "calls into the library namespace cub::"),
    ("ex12.3", _cuda_src(_MERGE_CUDA, ("#include <cuda_fp16.h>",
                                       '#include <cuda_fp16.h>\n#include "paged_attention.cu"')),
     "includes paged_attention.cu, the book's own kernels"),
    ("ex12.4", _cuda_src(_SCORES_CUDA, ("#include <cuda_fp16.h>",
                                        '#include <cuda_fp16.h>\n#include "../kernels/'
                                        'common.cuh"')),
     "the book's own kernels"),
    ("ex12.3", _MERGE_CUDA + "\n// paged_merge_v1 in a comment names nothing\n"
     "extern \"C\" __global__ void w(float* o) { paged_merge_v1<<<1, 1>>>(0, 0, 0, 0, 0, 0, 0); }",
     "names paged_merge_v1, the book's own kernel"),
    ("ex12.3", _book_merge_renamed(), "body of the book's own kernel paged_merge_v1"),
    ("ex12.3", 42, r"expected the CUDA C\+\+ source as a str"),
], ids=["cub-header", "thrust-header", "cub-namespace", "book-include", "book-header",
        "book-kernel-named", "book-kernel-pasted", "not-a-str"])
def test_cuda_exercise_refuses_libraries_and_the_book_kernel_on_any_machine(ex, src, expect):
    from cudabook.graders import GradeError

    with pytest.raises(GradeError, match=f"{ex}: .*{expect}"):
        _grader(ex)(src)


@pytest.mark.skipif(cb.HAS_GPU, reason="on a GPU the grader runs the kernel")
@pytest.mark.parametrize("ex", sorted(_CUDA))
def test_cuda_exercise_needs_a_gpu_after_its_static_checks(ex):
    from cudabook.graders import GradeError

    with pytest.raises(GradeError, match=f"{ex}: needs a CUDA GPU"):
        _grader(ex)(_CUDA[ex])


def _all_variants():
    for ex, wrong in (("ex12.3", _MERGE_WRONG), ("ex12.4", _SCORES_WRONG)):
        yield ex, _CUDA[ex]
        for edits, _ in wrong:
            yield ex, _cuda_src(_CUDA[ex], *edits)
    yield "ex12.4", _cuda_src(_SCORES_CUDA, *_SCORES_SHARED)


@pytest.mark.parametrize("arch", ["compute_75", "compute_80", "compute_90"])
def test_cuda_exercise_answers_compile_with_nvrtc(arch):
    """Every answer the GPU tests grade compiles as the grader compiles it (NVRTC, no GPU
    needed), and defines its kernel: a GPU test then fails for its hint, never for a typo."""
    from cudabook.graders._static import cuda_ptx, ptx_instructions

    for ex, src in _all_variants():
        ptx = cuda_ptx(ex, src, arch)
        if ptx is None:
            pytest.skip("NVRTC cannot be loaded here")
        assert ptx_instructions(ex, ptx, _CUDA_KERNEL[ex]), ex


@gpu
@pytest.mark.parametrize("ex, edits", [("ex12.3", []), ("ex12.4", []),
                                       ("ex12.4", _SCORES_SHARED)],
                         ids=["merge", "scores", "scores-shared-q"])
def test_cuda_exercise_right_answer_passes(ex, edits, capsys):
    _grader(ex)(_cuda_src(_CUDA[ex], *edits))
    assert capsys.readouterr().out == f"PASS {ex}\n"


@gpu
@pytest.mark.parametrize("ex, edits, expect",
                         [("ex12.3", e, h) for e, h in _MERGE_WRONG]
                         + [("ex12.4", e, h) for e, h in _SCORES_WRONG],
                         ids=["not-rescaled", "max-from-zero", "32-columns", "averaged", "exp2",
                              "past-the-end", "block-off-by-one", "row-0", "no-mask",
                              "no-guard", "no-scale", "half-accumulator"])
def test_cuda_exercise_wrong_answer_gets_its_hint(ex, edits, expect):
    from cudabook.graders import GradeError

    with pytest.raises(GradeError, match=f"{ex}: .*{expect}"):
        _grader(ex)(_cuda_src(_CUDA[ex], *edits))


# ----------------------------------------------------------------------------- append twins
def test_numba_rope_append_twin_rotates_at_each_rows_position_and_fills_only_its_slot():
    rng = np.random.default_rng(8)
    B, H, Hkv, D, BS, MB, NB = 4, 4, 2, 16, 4, 3, 12
    lens = np.array([1, 4, 5, 12], np.int32)                 # a block's first, last, next; full
    table = rng.permutation(NB)[:B * MB].reshape(B, MB).astype(np.int32)
    qkv = rng.standard_normal((B, (H + 2 * Hkv) * D)).astype(np.float32)
    q0 = np.full((B, H, D), np.nan, np.float32)
    kp0, vp0 = (np.full((NB, Hkv, BS, D), np.nan, np.float32) for _ in range(2))
    q, kp, vp = pa.rope_append_numba(qkv, q0, kp0, vp0, table, lens)
    qr, kr = pa.rope_reference(qkv, lens, H, Hkv, D)
    np.testing.assert_allclose(q, qr, rtol=1e-4, atol=1e-4)
    t = lens - 1
    blk, off = table[np.arange(B), t // BS], t % BS
    np.testing.assert_allclose(kp[blk, :, off], kr, rtol=1e-4, atol=1e-4)
    v = qkv.reshape(B, H + 2 * Hkv, D)[:, H + Hkv:]
    np.testing.assert_array_equal(vp[blk, :, off], v)
    written = np.zeros((NB, BS), bool)
    written[blk, off] = True
    assert np.isnan(kp.transpose(0, 2, 1, 3)[~written]).all()


def test_numba_write_twin_copies_positions_below_the_length_only():
    rng = np.random.default_rng(9)
    Hkv, T, D, BS, NB, n = 2, 16, 8, 4, 6, 9                 # 9 of 16 rows: 3 blocks, one partial
    row = np.array([4, 0, 2, -1], np.int32)
    k, v = (rng.standard_normal((Hkv, T, D)).astype(np.float32) for _ in range(2))
    kp0, vp0 = (np.full((NB, Hkv, BS, D), np.nan, np.float32) for _ in range(2))
    kp, vp = pa.write_prompt_numba(k, v, kp0, vp0, row, n)
    tt = np.arange(n)
    np.testing.assert_array_equal(kp[row[tt // BS], :, tt % BS], k[:, :n].transpose(1, 0, 2))
    np.testing.assert_array_equal(vp[row[tt // BS], :, tt % BS], v[:, :n].transpose(1, 0, 2))
    written = np.zeros((NB, BS), bool)
    written[row[tt // BS], tt % BS] = True
    assert np.isnan(vp.transpose(0, 2, 1, 3)[~written]).all()
