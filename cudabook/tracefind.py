"""Findings from a ``cb.trace`` record: what a kernel did wrong, as data and as one-line messages.

    f = cb.trace(kernel, grid, block, *args).findings()
    f.ok                    # nothing below was found
    f.out_of_bounds         # accesses outside an array, with the thread and line
    f.races                 # two threads, one element, at least one write, no barrier between
    f.uninitialized         # shared memory read before any thread of the block wrote it
    f.multiple_writes       # global elements written by more than one thread
    f.never_written         # {array: flat indices} of outputs with holes
    f.uneven_barriers       # blocks whose threads passed different numbers of barriers
    f.message()             # the most important finding, one line (None when ok)
    f.messages()            # all of them, most important first
    f.message(only={"races"})   # only some kinds (the attribute names above)

In a grader (``GradeError`` from ``cudabook.graders._core``)::

    msg = cb.trace(kernel, grid, block, *args).findings(outputs=["out"]).message()
    if msg:
        raise GradeError(f"{ex}: {case}: {msg}")

What counts as ordered: two accesses of one thread (program order); accesses of one block in
different barrier phases (``cuda.syncthreads()`` orders shared and global memory for the block).
Nothing orders different blocks within a launch. Atomic accesses never race with each other.
A race is reported even when the simulator (or the GPU) happened to compute the right numbers:
the hardware may hide it for years and expose it on the next GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from .tracer import ATOMIC, READ, WRITE, Site, Trace

__all__ = ["Findings", "Race", "MultiWrite", "Uninitialized", "UnevenBarriers", "analyse",
           "ranges", "KINDS"]

MAX_EACH = 200      # findings kept per kind (the counts stay exact)
KINDS = ("out_of_bounds", "races", "uninitialized", "multiple_writes", "never_written",
         "uneven_barriers")


@dataclass
class Race:
    """Two threads touch ``array[index]``, at least one writes, and nothing orders them."""

    array: str
    space: str
    index: tuple[int, ...]
    kind: str                  # "write-write" or "read-write"
    first: tuple[int, int, int, str, Site]    # (block, thread, phase, "read"/"write", site)
    second: tuple[int, int, int, str, Site]


@dataclass
class MultiWrite:
    array: str
    index: tuple[int, ...]
    writers: list[tuple[int, int, int]]       # (block, thread, phase), distinct threads


@dataclass
class Uninitialized:
    array: str
    index: tuple[int, ...]
    block: int
    thread: int
    phase: int
    site: Site


@dataclass
class UnevenBarriers:
    block: int
    counts: dict[int, int]      # barriers passed -> how many threads


@dataclass
class Findings:
    trace: Trace
    out_of_bounds: list = field(default_factory=list)
    races: list[Race] = field(default_factory=list)
    uninitialized: list[Uninitialized] = field(default_factory=list)
    multiple_writes: list[MultiWrite] = field(default_factory=list)
    never_written: dict[str, np.ndarray] = field(default_factory=dict)
    uneven_barriers: list[UnevenBarriers] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)   # exact totals per kind

    @property
    def ok(self) -> bool:
        return not (self.out_of_bounds or self.races or self.uninitialized or
                    self.multiple_writes or any(v.size for v in self.never_written.values())
                    or self.uneven_barriers)

    def message(self, only: Iterable[str] | None = None) -> str | None:
        """The most important finding as one line, or None (``only``: as in ``messages``)."""
        m = self.messages(limit=1, only=only)
        return m[0] if m else None

    def messages(self, limit: int | None = None,
                 only: Iterable[str] | None = None) -> list[str]:
        """One line per kind of finding, most important first: out of bounds, race,
        uninitialised shared read, double write, gap, uneven barriers. ``only``: the kinds to
        report, by their attribute names (``{"races", "out_of_bounds"}``)."""
        want = set(KINDS if only is None else only)
        if want - set(KINDS):
            raise ValueError(f"unknown finding kinds {sorted(want - set(KINDS))}; known: "
                             f"{KINDS}")
        t, out = self.trace, []
        if self.out_of_bounds and "out_of_bounds" in want:
            out.append(_oob_msg(t, self.out_of_bounds, self.counts["out_of_bounds"]))
        if self.races and "races" in want:
            out.append(_race_msg(t, self.races[0], self.counts["races"]))
        if self.uninitialized and "uninitialized" in want:
            out.append(_uninit_msg(t, self.uninitialized[0], self.counts["uninitialized"]))
        if self.multiple_writes and "multiple_writes" in want:
            out.append(_multi_msg(t, self.multiple_writes[0], self.counts["multiple_writes"]))
        for name, idx in self.never_written.items():
            if idx.size and "never_written" in want:
                out.append(_gap_msg(t, name, idx))
        if self.uneven_barriers and "uneven_barriers" in want:
            u = self.uneven_barriers[0]
            lo, hi = min(u.counts), max(u.counts)
            out.append(f"block {_blk(t, u.block)}: its threads passed different numbers of "
                       f"cuda.syncthreads() ({lo} to {hi}): a barrier inside a branch, or "
                       "an early return before it? (undefined behaviour on a GPU)")
        return out[:limit] if limit else out

    def __repr__(self) -> str:
        if self.ok:
            return f"<Findings {self.trace.kernel}: nothing found>"
        return "\n".join(self.messages())


# ============================================================================ analysis
def analyse(t: Trace, outputs: list[str] | None = None) -> Findings:
    """All findings of a trace. ``outputs``: the arrays checked for elements never written
    (default: every global array that the kernel writes at least once)."""
    f = Findings(t)
    # by thread, not in the order the simulator happened to run the threads
    f.out_of_bounds = sorted(t.oob, key=lambda o: (o.block, o.thread, o.phase))[:MAX_EACH]
    f.counts["out_of_bounds"] = len(t.oob)
    acc = t.acc
    space = np.array([a.space for a in t.arrays] or [""], dtype=object)
    is_shared = (space[acc["array"]] == "shared") if len(acc) else np.zeros(0, bool)
    _shared_races(t, acc[is_shared], f)
    _global_races(t, acc[~is_shared & (space[acc["array"]] == "global")]
                  if len(acc) else acc, f)
    _uninitialized(t, acc[is_shared], f)
    if outputs is None:
        outputs = [a.name for a in t.arrays if a.space == "global" and
                   np.any((acc["array"] == a.id) & (acc["kind"] != READ))]
    for name in outputs:
        f.never_written[name] = np.flatnonzero(t.counts(name, WRITE).ravel() +
                                               t.counts(name, ATOMIC).ravel() == 0)
    for b in range(t.nblocks):
        c = t.barriers[b]
        if c.min() != c.max():
            vals, n = np.unique(c, return_counts=True)
            f.uneven_barriers.append(UnevenBarriers(b, dict(zip(vals.tolist(), n.tolist()))))
    f.counts["uneven_barriers"] = len(f.uneven_barriers)
    return f


def _groups(keys: list[np.ndarray]):
    """Sort order and group starts of rows with equal keys (lexicographic)."""
    order = np.lexsort(keys[::-1])
    if order.size == 0:
        return order, np.zeros(0, np.int64), np.zeros(0, np.int64)
    k = np.stack([x[order] for x in keys])
    new = np.ones(order.size, bool)
    new[1:] = (k[:, 1:] != k[:, :-1]).any(axis=0)
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], order.size)
    return order, starts, ends


def _candidates(acc: np.ndarray, who: np.ndarray, keys: list[np.ndarray]):
    """(sorted row numbers, start, end) of the groups with a plain write and two threads."""
    order, starts, ends = _groups(keys)
    if order.size == 0:
        return order, []
    w = (acc["kind"][order] == WRITE).astype(np.int8)
    q = who[order]
    keep = ((np.maximum.reduceat(w, starts) > 0) &
            (np.minimum.reduceat(q, starts) != np.maximum.reduceat(q, starts)))
    return order, list(zip(starts[keep], ends[keep]))


def _row(t: Trace, r) -> tuple[int, int, int, str, Site]:
    return (int(r["block"]), int(r["thread"]), int(r["phase"]),
            "write" if r["kind"] == WRITE else "read", t.sites[int(r["site"])])


def _shared_races(t: Trace, acc: np.ndarray, f: Findings) -> None:
    """Same block, same phase, same element, different threads, at least one plain write."""
    acc = acc[acc["kind"] != ATOMIC]
    order, cand = _candidates(acc, acc["thread"].astype(np.int64),
                              [acc["array"], acc["block"], acc["phase"], acc["index"]])
    n = 0
    for s, e in cand:
        g = acc[order[s:e]]
        w = g["kind"] == WRITE
        wr = g[w][0]
        other = g[g["thread"] != wr["thread"]]
        if other.size == 0:       # every write by one thread; a read by another
            continue
        oth = other[other["kind"] == WRITE][0] if (other["kind"] == WRITE).any() else other[0]
        n += 1
        if len(f.races) < MAX_EACH:
            a = t.arrays[int(wr["array"])]
            f.races.append(Race(a.name, "shared", a.index(int(wr["index"])),
                                "write-write" if oth["kind"] == WRITE else "read-write",
                                _row(t, wr), _row(t, oth)))
    f.counts["races"] = f.counts.get("races", 0) + n


def _global_races(t: Trace, acc: np.ndarray, f: Findings) -> None:
    """Global elements: write-write by different threads -> multiple_writes; a read and a write
    by different threads that no barrier orders (other block, or same block and phase) -> race."""
    acc = acc[acc["kind"] != ATOMIC]
    gid = t.gid(acc["block"], acc["thread"]).astype(np.int64)
    order, cand = _candidates(acc, gid, [acc["array"], acc["index"]])
    nmw = nr = 0
    for s, e in cand:
        rows = order[s:e]
        g, gg = acc[rows], gid[rows]
        w = g["kind"] == WRITE
        a = t.arrays[int(g["array"][0])]
        idx = a.index(int(g["index"][0]))
        wg = gg[w]
        if np.unique(wg).size > 1:
            nmw += 1
            if len(f.multiple_writes) < MAX_EACH:
                seen, writers = set(), []
                for r, q in zip(g[w], wg):
                    if q not in seen:
                        seen.add(q)
                        writers.append((int(r["block"]), int(r["thread"]), int(r["phase"])))
                f.multiple_writes.append(MultiWrite(a.name, idx, writers))
        rd = g[~w]
        hit = None
        for wr, q in zip(g[w], wg):
            bad = (t.gid(rd["block"], rd["thread"]) != q) & (
                (rd["block"] != wr["block"]) | (rd["phase"] == wr["phase"]))
            if bad.any():
                hit = (wr, rd[bad][0])
                break
        if hit is not None:
            nr += 1
            if len(f.races) < MAX_EACH:
                f.races.append(Race(a.name, "global", idx, "read-write", _row(t, hit[0]),
                                    _row(t, hit[1])))
    f.counts["multiple_writes"] = nmw
    f.counts["races"] = f.counts.get("races", 0) + nr


def _uninitialized(t: Trace, acc: np.ndarray, f: Findings) -> None:
    """Shared reads with no write before them: none in an earlier phase, none earlier by the
    same thread, and none by another thread in the same phase (that one is a race)."""
    seq = np.arange(acc.size)
    order, starts, ends = _groups([acc["array"], acc["block"], acc["index"]])
    n = 0
    if order.size:
        big = np.iinfo(np.int64).max
        ph = acc["phase"][order].astype(np.int64)
        wph = np.where(acc["kind"][order] != READ, ph, big)
        first_w = np.repeat(np.minimum.reduceat(wph, starts), ends - starts)
        is_read = acc["kind"][order] == READ
        sus = np.flatnonzero(is_read & (ph <= first_w))   # no write in an earlier phase
        grp = np.repeat(np.arange(starts.size), ends - starts)
        for j in sus:
            r = acc[order[j]]
            if ph[j] == first_w[j]:     # writes in this phase: by another thread, or earlier
                s, e = starts[grp[j]], ends[grp[j]]
                g = acc[order[s:e]]
                wm = (g["kind"] != READ) & (g["phase"] == r["phase"])
                if ((g["thread"] != r["thread"]) & wm).any() or \
                        ((g["thread"] == r["thread"]) & wm & (seq[order[s:e]] < order[j])).any():
                    continue
            n += 1
            if len(f.uninitialized) < MAX_EACH:
                a = t.arrays[int(r["array"])]
                f.uninitialized.append(Uninitialized(
                    a.name, a.index(int(r["index"])), int(r["block"]), int(r["thread"]),
                    int(r["phase"]), t.sites[int(r["site"])]))
    f.counts["uninitialized"] = n


# ============================================================================ messages
def _el(name: str, idx: tuple[int, ...]) -> str:
    return f"{name}[{', '.join(str(v) for v in idx)}]"


def _blk(t: Trace, b: int) -> str:
    bi = t.block_index(b)
    if t.grid[1:] == (1, 1):
        return str(b)
    return str(bi[:3] if t.grid[2] > 1 else bi[:2])


def _more(n: int, what: str) -> str:
    return f" ({n} {what} in all)" if n > 1 else ""


def _oob_msg(t: Trace, oob: list, n: int) -> str:
    o = next((x for x in oob if not x.wrapped), oob[0])
    verb = {"read": "read", "write": "written", "atomic": "updated atomically"}[o.kind]
    head = (f"{_el(o.array, o.index)} {verb} out of bounds ({o.array} has shape "
            f"{o.shape}) by {t.who(o.block, o.thread)}, {o.site}")
    if o.wrapped:
        return (head + ": a negative index (Numba wraps it to the other end; CUDA C++ reads "
                "before the array): missing a 0 <= index check?" + _more(n, "such accesses"))
    return head + ": missing bounds guard?" + _more(n, "out-of-bounds accesses")


def _race_msg(t: Trace, r: Race, n: int) -> str:
    (b1, t1, _, _, s1), (b2, t2, _, _, s2) = r.first, r.second
    el = _el(r.array, r.index)
    if r.space == "shared":
        if r.kind == "write-write":
            return (f"race on shared {el} in block {_blk(t, b1)}: written by "
                    f"{_thr(t, b1, t1)} ({s1}) and by {_thr(t, b2, t2)} ({s2}) between the "
                    "same two barriers: two threads store to one element" + _more(n, "races"))
        return (f"race on shared {el} in block {_blk(t, b1)}: {_thr(t, b1, t1)} writes it "
                f"({s1}) and {_thr(t, b2, t2)} reads it ({s2}) with no cuda.syncthreads() "
                "between them: missing barrier?" + _more(n, "races"))
    why = ("nothing orders two blocks within a launch" if b1 != b2 else
           "no cuda.syncthreads() between them")
    return (f"race on {el}: {t.who(b1, t1)} writes it ({s1}) and {t.who(b2, t2)} reads it "
            f"({s2}); {why}" + _more(n, "races"))


def _thr(t: Trace, b: int, th: int) -> str:
    if t.block[1:] == (1, 1):
        return f"thread {th}"
    ti = t.thread_index(th)
    return f"thread {ti[:3] if t.block[2] > 1 else ti[:2]}"


def _uninit_msg(t: Trace, u: Uninitialized, n: int) -> str:
    return (f"shared {_el(u.array, u.index)} read by {_thr(t, u.block, u.thread)} of block "
            f"{_blk(t, u.block)} ({u.site}) before any thread of the block wrote it: it holds "
            "garbage (does the block have as many threads as the shared array has "
            "elements?)" + _more(n, "such reads"))


def _multi_msg(t: Trace, m: MultiWrite, n: int) -> str:
    (b1, t1, _), (b2, t2, _) = m.writers[:2]
    el = _el(m.array, m.index)
    if t.grid[1:] == (1, 1) and t.block[1:] == (1, 1):
        who = f"threads {int(t.gid(b1, t1))} and {int(t.gid(b2, t2))}"
        where = f"blocks {b1} and {b2}" if b1 != b2 else f"both of block {b1}"
        head = f"{el} written by {who} ({where})"
    else:
        head = f"{el} written by {t.who(b1, t1)} and by {t.who(b2, t2)}"
    hint = ("two blocks cover the same range" if b1 != b2 else
            "two threads of one block compute the same index")
    return f"{head}: {hint}" + _more(n, "elements written more than once")


def ranges(idx: np.ndarray) -> list[tuple[int, int]]:
    """Runs of consecutive integers: [3, 4, 5, 9] -> [(3, 5), (9, 9)]."""
    idx = np.asarray(idx)
    if idx.size == 0:
        return []
    cut = np.flatnonzero(np.diff(idx) != 1)
    starts = np.append(idx[0], idx[cut + 1])
    ends = np.append(idx[cut], idx[-1])
    return list(zip(starts.tolist(), ends.tolist()))


def _gap_msg(t: Trace, name: str, idx: np.ndarray) -> str:
    a = t.array(name)
    if len(a.shape) == 1:
        rs = ranges(idx)
        parts = [f"{lo}" if lo == hi else f"{lo}..{hi}" for lo, hi in rs[:3]]
        where = f"{name}[{', '.join(parts)}{', ...' if len(rs) > 3 else ''}]"
    else:
        where = f"{a.fmt(int(idx[0]))} (the first)"
    tail = len(a.shape) == 1 and idx[-1] == a.size - 1 and ranges(idx)[-1][0] > 0 and \
        len(ranges(idx)) == 1
    hint = ("the grid stops short of the end: round the block count up, or loop with a "
            "grid stride" if tail else "a wrong index or stride leaves holes")
    return f"{where} never written ({idx.size} of {a.size} elements): {hint}?"
