"""Warp-level memory requests from a ``cb.trace`` record: 32-byte sectors per global load or
store (coalescing) and shared-memory wavefronts per access (bank conflicts).

    reqs = tracemem.requests(t, "x")      # one row per warp-wide request to x
    tracemem.summary(t)                   # per array and source line: sectors or wavefronts

A *request* is what one warp does at one source position in one go: the lanes of a warp that
execute the same subscript for the k-th time (the record's ``site`` and ``occ``). Its columns:

* ``lanes``     active lanes (threads of the warp that made the access);
* ``bytes``     distinct bytes touched (lanes reading one element count once);
* ``sectors``   distinct 32-byte sectors touched, the unit in which DRAM and L2 serve a load
  (addresses are counted from the array's start, which ``cudaMalloc`` aligns to 256 bytes);
* ``ideal``     the fewest sectors that many distinct bytes could occupy: ceil(bytes / 32);
* ``wavefronts`` (shared memory) the passes the access needs: the largest number of distinct
  4-byte words that fall in one of the 32 banks (bank = word index % 32). 1 is conflict-free;
  lanes reading the same word are served by one broadcast. Elements wider than 4 bytes occupy
  several words, so 8-byte accesses of 32 lanes need at least 2.

The model is the one PMPP and the CUDA guide teach; it ignores the L1 cache, the order of
lanes within a sector, and the 128-byte alignment rules of GPUs before compute capability 6.0.
"""

from __future__ import annotations

import numpy as np

from .tracer import ATOMIC, KIND_NAMES, READ, WRITE, Trace

__all__ = ["REQUEST_DTYPE", "requests", "summary", "Summary", "SECTOR", "BANKS"]

SECTOR = 32     # bytes
BANKS = 32
WORD = 4        # bytes per bank per cycle

REQUEST_DTYPE = np.dtype([("array", np.int32), ("kind", np.int8), ("block", np.int32),
                          ("warp", np.int32), ("site", np.int32), ("occ", np.int32),
                          ("phase", np.int32), ("lanes", np.int32), ("bytes", np.int64),
                          ("sectors", np.int32), ("ideal", np.int32),
                          ("wavefronts", np.int32)])


def _reduce_distinct(group: np.ndarray, value: np.ndarray, ngroups: int) -> np.ndarray:
    """Per group, the number of distinct values."""
    if group.size == 0:
        return np.zeros(ngroups, np.int64)
    pairs = np.unique(np.stack([group, value]), axis=1)
    return np.bincount(pairs[0], minlength=ngroups)


def requests(t: Trace, name: str | None = None, kind: int | str | None = None, *,
             block: int | None = None, warp: int | None = None,
             line: int | None = None) -> np.ndarray:
    """One row per warp-wide request (``REQUEST_DTYPE``), for one array or all of them,
    optionally only one kind (READ, WRITE, ATOMIC or their names), block, warp, source line."""
    acc = t.accesses(name, kind, block=block)
    if line is not None:
        lines = np.array([s.line for s in t.sites] or [0])
        acc = acc[lines[acc["site"]] == line]
    w = acc["thread"] // 32
    if warp is not None:
        acc, w = acc[w == warp], w[w == warp]
    out = np.zeros(0, REQUEST_DTYPE)
    if acc.size == 0:
        return out
    keys = [acc["array"], acc["kind"], acc["block"], w, acc["site"], acc["occ"]]
    order = np.lexsort(keys[::-1])
    k = np.stack([x[order] for x in keys]).astype(np.int64)
    new = np.ones(order.size, bool)
    new[1:] = (k[:, 1:] != k[:, :-1]).any(axis=0)
    starts = np.flatnonzero(new)
    ng = starts.size
    grp = np.cumsum(new) - 1                      # group of each sorted row
    a = acc[order]
    isz = np.array([x.itemsize for x in t.arrays])[a["array"]]
    byte = a["index"] * isz
    out = np.zeros(ng, REQUEST_DTYPE)
    for col, src in (("array", a["array"]), ("kind", a["kind"]), ("block", a["block"]),
                     ("site", a["site"]), ("occ", a["occ"]), ("phase", a["phase"])):
        out[col] = src[starts]
    out["warp"] = w[order][starts]
    out["lanes"] = _reduce_distinct(grp, a["thread"], ng)
    nelem = _reduce_distinct(grp, a["index"], ng)
    out["bytes"] = nelem * isz[starts]
    out["sectors"] = _reduce_distinct(grp, byte // SECTOR, ng)
    out["ideal"] = -(-out["bytes"] // SECTOR)
    shared = np.array([x.space == "shared" for x in t.arrays])[a["array"]]
    if shared.any():
        # every 4-byte word each element covers: (group, word) pairs, then words per bank
        nw = np.maximum(isz // WORD, 1)
        rep = np.repeat(np.arange(a.size), nw)
        off = np.arange(rep.size) - np.repeat(np.cumsum(nw) - nw, nw)
        word = byte[rep] // WORD + off
        keep = shared[rep]
        g, wd = grp[rep][keep], word[keep]
        pairs = np.unique(np.stack([g, wd]), axis=1)
        per_bank = np.bincount(pairs[0] * BANKS + pairs[1] % BANKS, minlength=ng * BANKS)
        out["wavefronts"] = per_bank.reshape(ng, BANKS).max(axis=1)
    return out


class Summary:
    """Per (array, kind, source line): requests, sectors or wavefronts per request. ``rows`` is
    a list of dicts; printing it gives a table."""

    def __init__(self, rows: list[dict]):
        self.rows = rows

    def row(self, array: str, kind: str = "read", line: int | None = None) -> dict:
        for r in self.rows:
            if r["array"] == array and r["kind"] == kind and (line is None or
                                                               r["line"] == line):
                return r
        raise KeyError(f"no {kind} of {array}" + (f" on line {line}" if line else ""))

    def __repr__(self) -> str:
        head = (f"{'array':<8} {'space':<6} {'kind':<6} {'line':>4}  {'requests':>8}  "
                f"{'sectors/req':>11}  {'ideal':>5}  {'wavefronts/req':>14}  access")
        out = [head]
        for r in self.rows:
            sec = f"{r['sectors']:.1f}" if r["space"] != "shared" else "-"
            ide = f"{r['ideal']:.1f}" if r["space"] != "shared" else "-"
            wav = f"{r['wavefronts']:.1f}" if r["space"] == "shared" else "-"
            out.append(f"{r['array']:<8} {r['space']:<6} {r['kind']:<6} {r['line']:>4}  "
                       f"{r['requests']:>8}  {sec:>11}  {ide:>5}  {wav:>14}  {r['expr']}")
        return "\n".join(out)


def summary(t: Trace) -> Summary:
    """The average request of every array, kind and source position: sectors per request
    against the ideal (global memory), wavefronts per request (shared memory)."""
    r = requests(t)
    rows = []
    for site in np.unique(r["site"]):
        for kind in (READ, WRITE, ATOMIC):   # noqa: B007
            q = r[(r["site"] == site) & (r["kind"] == kind)]
            for aid in np.unique(q["array"]):
                qa = q[q["array"] == aid]
                a, s = t.arrays[int(aid)], t.sites[int(site)]
                rows.append(dict(array=a.name, space=a.space, kind=KIND_NAMES[kind],
                                 line=s.line, expr=s.expr, requests=int(qa.size),
                                 lanes=float(qa["lanes"].mean()),
                                 sectors=float(qa["sectors"].mean()),
                                 ideal=float(qa["ideal"].mean()),
                                 wavefronts=float(qa["wavefronts"].mean()),
                                 max_wavefronts=int(qa["wavefronts"].max())))
    rows.sort(key=lambda d: (d["line"], d["kind"] != "read"))
    return Summary(rows)
