"""Pictures of a ``cb.trace`` record (matplotlib): who wrote what, who read what, and how a warp's
accesses fall on memory sectors and shared-memory banks.

    from cudabook import tracedraw as td
    t = cb.trace(kernel, grid, block, *args)
    td.writers(t, "out", by="block")        # each element coloured by the block that wrote it
    td.writers(t, "out", by="count")        # never written (hatched) / once / twice or more
    td.reads(t, "x", by="count")            # how often each input element was read
    td.halo(t, "x", block=(1, 0), out="y")  # what one block reads, its own outputs outlined
    td.flow(t, "a", "out", threads=range(8))   # arrows: element read -> element written
    td.sectors(t, "x", warp=0)              # one warp's load: 32-byte sectors touched
    td.banks(t, "tile", warp=0, line=44)    # one warp's shared access: banks and conflicts
    td.phases(t, "s")                       # a shared array between barriers: the reduction tree

Every function draws into ``ax`` (a new figure when None) and returns the Axes; end the cell with
``plt.show()``. Elements are drawn as cells: a 2D array as it is (row 0 on top), a 1D array in
rows of ``wrap`` elements (32 by default: one warp, one row of banks for 4-byte elements).
Selections: ``block`` is a linear block id or a (x, y[, z]) tuple; ``warp`` counts warps in the
block; ``line`` picks a source line when an array is accessed on several.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from .tracemem import BANKS, SECTOR, WORD, requests
from .tracer import READ, WRITE, Trace

__all__ = ["writers", "reads", "halo", "flow", "sectors", "banks", "phases"]

NEVER = "#f4f4f4"


def _plt():
    import matplotlib.pyplot as plt

    return plt


def _block_id(t: Trace, block) -> int | None:
    if block is None or isinstance(block, (int, np.integer)):
        return None if block is None else int(block)
    b = tuple(block) + (0,) * (3 - len(tuple(block)))
    return b[0] + t.grid[0] * (b[1] + t.grid[1] * b[2])


def _shape2d(shape: tuple[int, ...], wrap: int | None) -> tuple[int, int]:
    if len(shape) == 1:
        cols = wrap or min(shape[0], 32)
        return -(-shape[0] // cols), cols
    if len(shape) == 2:
        return shape
    raise ValueError(f"tracedraw draws 1D and 2D arrays, not shape {shape}")


def _to2d(flat: np.ndarray, shape, wrap, fill=np.nan) -> np.ndarray:
    rows, cols = _shape2d(shape, wrap)
    out = np.full(rows * cols, fill, dtype=float)
    out[:flat.size] = flat
    return out.reshape(rows, cols)


def _cell_xy(shape, wrap, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(column, row) of flat element indices in the drawing."""
    _, cols = _shape2d(shape, wrap)
    flat = np.asarray(flat)
    return flat % cols, flat // cols


def _axes(ax, shape, wrap, height_extra=0.9, max_w=11.0):
    if ax is not None:
        return ax
    rows, cols = _shape2d(shape, wrap)
    cell = min(0.34, max_w / cols, 7.0 / max(rows, 1))
    _, ax = _plt().subplots(figsize=(max(cols * cell + 1.6, 4), rows * cell + height_extra))
    return ax


def _frame(ax, shape, wrap, title: str) -> None:
    rows, cols = _shape2d(shape, wrap)
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    ax.set_aspect("equal")
    step_c = max(1, int(np.ceil(cols / 16)))
    step_r = max(1, int(np.ceil(rows / 16)))
    ax.set_xticks(np.arange(0, cols, step_c) + 0.5, [str(c) for c in range(0, cols, step_c)],
                  fontsize=7)
    if len(shape) == 1:
        ax.set_yticks(np.arange(0, rows, step_r) + 0.5,
                      [str(r * cols) for r in range(0, rows, step_r)], fontsize=7)
        ax.set_ylabel("index of the row's first element", fontsize=7)
    else:
        ax.set_yticks(np.arange(0, rows, step_r) + 0.5, [str(r) for r in range(0, rows, step_r)],
                      fontsize=7)
        ax.set_xlabel("column", fontsize=7)
        ax.set_ylabel("row", fontsize=7)
    ax.tick_params(length=0)
    for s in ax.spines.values():
        s.set_visible(False)
    ax.set_title(title, fontsize=9)


def _label_size(ax, shape, wrap, chars: int) -> float:
    fig = ax.figure
    rows, cols = _shape2d(shape, wrap)
    w_pt = ax.get_position().width * fig.get_figwidth() * 72
    h_pt = ax.get_position().height * fig.get_figheight() * 72
    cell = min(w_pt / cols, h_pt / max(rows, 1))
    return min(8.0, cell / (0.62 * max(chars, 1) + 0.4))


def _labels(ax, shape, wrap, flat: np.ndarray, text: list[str], colors=None,
            min_size: float = 3.6) -> None:
    """Write ``text`` in the cells ``flat``; white on dark ``colors`` (RGBA per cell)."""
    if not text:
        return
    size = _label_size(ax, shape, wrap, max(len(s) for s in text))
    if size < min_size:
        return
    x, y = _cell_xy(shape, wrap, flat)
    for k, (xi, yi, s) in enumerate(zip(x, y, text)):
        c = "black"
        if colors is not None:
            r, g, b = colors[k][:3]
            c = "white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.5 else "black"
        ax.text(xi + 0.5, yi + 0.5, s, ha="center", va="center", fontsize=size, color=c)


def _categorical(n: int):
    plt = _plt()
    from matplotlib.colors import ListedColormap

    if n <= 10:
        return ListedColormap(plt.cm.tab10.colors[:max(n, 1)])
    if n <= 20:
        return ListedColormap(plt.cm.tab20.colors[:n])
    return plt.cm.turbo


def _mesh(ax, data: np.ndarray, cmap, vmin, vmax):
    rows, cols = data.shape
    m = np.ma.masked_invalid(data)
    ax.pcolormesh(np.arange(cols + 1), np.arange(rows + 1), m, cmap=cmap, vmin=vmin, vmax=vmax,
                  edgecolors="white", linewidth=0.4)


def _hatch(ax, shape, wrap, flat: np.ndarray, **kw) -> None:
    plt = _plt()
    x, y = _cell_xy(shape, wrap, flat)
    for xi, yi in zip(x, y):
        ax.add_patch(plt.Rectangle((xi, yi), 1, 1, fill=False, **kw))


def _background(ax, shape, wrap) -> None:
    rows, cols = _shape2d(shape, wrap)
    size = int(np.prod(shape))
    bg = np.where(np.arange(rows * cols) < size, 0.0, np.nan).reshape(rows, cols)
    from matplotlib.colors import ListedColormap

    _mesh(ax, bg, ListedColormap([NEVER]), 0, 1)


# ============================================================================ writers
def writers(t: Trace, name: str, by: str = "block", *, label: str | None = "auto",
            block=None, phase: int | None = None, wrap: int | None = None, ax=None,
            title: str | None = None):
    """``name`` drawn cell by cell, coloured by who wrote each element.

    ``by``: "block", "warp" (global warp id), "thread" (global id), "lane", or "count" (how many
    writes: hatched = never, green = once, red = more). ``label``: the number written in each
    cell: "thread" (global id), "local" (thread index in its block: x, or (x, y)), "block",
    "warp", "lane", None, or "auto" (the local thread when the cells are big enough). Elements
    never written are hatched; elements written by several threads have a red border.
    ``block``/``phase`` restrict the writes (e.g. one block's shared tile in one phase); with
    ``block`` given, "thread" and "warp" count within that block."""
    plt = _plt()
    a = t.array(name)
    b = _block_id(t, block)
    r = t.accesses(name, None, block=b, phase=phase)
    r = r[r["kind"] != READ]
    ax = _axes(ax, a.shape, wrap)
    count = np.bincount(r["index"], minlength=a.size)
    gid = t.gid(r["block"], r["thread"])
    distinct = np.zeros(a.size, np.int64)
    if r.size:
        pairs = np.unique(np.stack([r["index"], gid]), axis=1)
        distinct = np.bincount(pairs[0], minlength=a.size)
    _background(ax, a.shape, wrap)
    if by == "count":
        vals = np.where(count == 0, np.nan, np.minimum(count, 2).astype(float))
        from matplotlib.colors import ListedColormap

        _mesh(ax, _to2d(vals, a.shape, wrap), ListedColormap(["#8fd18f", "#e05a4f"]), 1, 2)
        what = "how many times each element was written (green once, red more)"
    else:
        if b is not None and by in ("thread", "warp"):     # one block: count within it
            by = {"thread": "local", "warp": "local_warp"}[by]
        w = t.writer(name, by, block=b, phase=phase).ravel().astype(float)
        w[w < 0] = np.nan
        ids = np.unique(w[~np.isnan(w)])
        ncat = int(ids.max()) + 1 if ids.size else 1
        cmap = _categorical(ncat)
        _mesh(ax, _to2d(w, a.shape, wrap), cmap, -0.5, ncat - 0.5)
        what = ("each element coloured by the " + {"local": "thread", "local_warp": "warp"}
                .get(by, by) + " that wrote it")
        if cmap is plt.cm.turbo:
            sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, ncat - 1))
            ax.figure.colorbar(sm, ax=ax, fraction=0.03, pad=0.02).set_label(by, fontsize=7)
        elif by in ("block", "warp", "local_warp") and ids.size <= 10:
            from matplotlib.patches import Patch

            handles = [Patch(color=cmap(int(i)), label=f"{by.replace('local_', '')} "
                                                          f"{_nice_id(t, by, int(i))}")
                       for i in ids]
            ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0),
                      frameon=False)
    never = np.flatnonzero(count == 0)
    _hatch(ax, a.shape, wrap, never, hatch="////", edgecolor="#b0b0b0", linewidth=0)
    twice = np.flatnonzero(distinct > 1)
    _hatch(ax, a.shape, wrap, twice, edgecolor="#d00000", linewidth=1.6)
    if label == "auto":
        label = "local" if t.block[1:] == (1, 1) else None
        if a.size > 1024:
            label = None
    if label:
        last = np.full(a.size, -1, np.int64)
        last_row = np.full(a.size, -1, np.int64)
        last[r["index"]] = gid
        last_row[r["index"]] = np.arange(r.size)
        has = np.flatnonzero(last >= 0)
        rows = r[last_row[has]]
        text = [_label(t, label, int(x["block"]), int(x["thread"])) for x in rows]
        colors = None
        if by != "count":
            wv = t.writer(name, by, block=b, phase=phase).ravel()[has]
            colors = cmap(wv / max(ncat - 1, 1)) if cmap is plt.cm.turbo else cmap(wv)
        _labels(ax, a.shape, wrap, has, text, colors)
    notes = []
    if never.size:
        notes.append(f"{never.size} never written (hatched)")
    if twice.size:
        notes.append(f"{twice.size} written by several threads (red)")
    if a.space == "global" and b is None and phase is None:
        idle = t.nblocks * t.nthreads - np.unique(t.gid(t.acc["block"], t.acc["thread"])).size
        if idle:
            notes.append(f"{idle} of {t.nblocks * t.nthreads} threads touched no memory")
    sel = (f", block {block}" if block is not None else "") + \
          (f", phase {phase}" if phase is not None else "")
    if label:
        notes.append(f"numbers: {_label_name(t, label)}")
    head = title or f"{t.kernel}: {name}{sel}, {what}"
    _frame(ax, a.shape, wrap, head + ("\n" + "; ".join(notes) if notes else ""))
    return ax


def _nice_id(t: Trace, by: str, i: int) -> str:
    if by == "block" and t.grid[1:] != (1, 1):
        bi = t.block_index(i)
        return str(bi[:3] if t.grid[2] > 1 else bi[:2])
    return str(i)


def _label(t: Trace, label: str, blk: int, th: int) -> str:
    if label == "thread":
        return str(int(t.gid(blk, th)))
    if label == "local":
        ti = t.thread_index(th)
        if t.block[1:] == (1, 1):
            return str(ti[0])
        return f"{ti[0]},{ti[1]}" if t.block[2] == 1 else f"{ti[0]},{ti[1]},{ti[2]}"
    if label == "block":
        return _nice_id(t, "block", blk).replace(" ", "")
    if label == "warp":
        return str(th // 32)
    if label == "lane":
        return str(th % 32)
    raise ValueError(f"label must be thread, local, block, warp, lane or None, not {label!r}")


def _label_name(t: Trace, label: str) -> str:
    local = ("threadIdx.x" if t.block[1:] == (1, 1) else "threadIdx.x,y" if t.block[2] == 1
             else "threadIdx.x,y,z")
    return {"thread": "global thread id", "local": local, "block": "blockIdx",
            "warp": "warp in the block", "lane": "lane"}[label]


# ============================================================================ reads
def reads(t: Trace, name: str, by: str = "count", *, block=None, thread: int | None = None,
          phase: int | None = None, wrap: int | None = None, ax=None, title: str | None = None,
          outline: Iterable[int] | None = None):
    """How ``name`` was read: ``by`` "count" (a heat map of reads per element), "phase" (the
    barrier phase of the first read: the order in which tiles are loaded), "block" or "thread"
    (who read it first). ``block`` / ``thread`` (global id) / ``phase`` restrict the reads;
    ``outline``: flat indices to outline in black (e.g. the elements the same block writes)."""
    plt = _plt()
    a = t.array(name)
    b = _block_id(t, block)
    r = t.accesses(name, READ, block=b, phase=phase)
    if thread is not None:
        r = r[t.gid(r["block"], r["thread"]) == thread]
    ax = _axes(ax, a.shape, wrap)
    _background(ax, a.shape, wrap)
    count = np.bincount(r["index"], minlength=a.size)
    if by == "count":
        vals = np.where(count == 0, np.nan, count.astype(float))
        vmax = max(int(count.max()) if count.size else 1, 1)
        _mesh(ax, _to2d(vals, a.shape, wrap), plt.cm.YlOrRd, 0, vmax)
        sm = plt.cm.ScalarMappable(cmap=plt.cm.YlOrRd, norm=plt.Normalize(0, vmax))
        ax.figure.colorbar(sm, ax=ax, fraction=0.03, pad=0.02).set_label("reads", fontsize=7)
        what = "reads per element"
        if vmax <= 99:
            has = np.flatnonzero(count)
            _labels(ax, a.shape, wrap, has, [str(c) for c in count[has]])
    else:
        first = np.full(a.size, np.nan)
        vals = {"phase": r["phase"].astype(float), "block": r["block"].astype(float),
                "thread": t.gid(r["block"], r["thread"]).astype(float)}[by]
        order = np.argsort(-np.arange(r.size))          # first read wins: assign in reverse
        first[r["index"][order]] = vals[order]
        ncat = int(np.nanmax(first)) + 1 if np.isfinite(first).any() else 1
        cmap = _categorical(ncat)
        _mesh(ax, _to2d(first, a.shape, wrap), cmap, -0.5, ncat - 0.5)
        if ncat <= 10:
            from matplotlib.patches import Patch

            ids = np.unique(first[np.isfinite(first)]).astype(int)
            ax.legend(handles=[Patch(color=cmap(int(i)), label=f"{by} {i}") for i in ids],
                      fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
        what = f"coloured by the {by} of the first read"
    if outline is not None:
        _hatch(ax, a.shape, wrap, np.asarray(list(outline)), edgecolor="black", linewidth=1.2)
    sel = (f", block {block}" if block is not None else "") + \
          (f", thread {thread}" if thread is not None else "") + \
          (f", phase {phase}" if phase is not None else "")
    _frame(ax, a.shape, wrap, title or f"{t.kernel}: {name}{sel}, {what}; "
                                       f"{int((count > 0).sum())} of {a.size} elements read")
    return ax


def halo(t: Trace, name: str, block, out: str | None = None, *, ax=None,
         title: str | None = None):
    """The elements of ``name`` that one block reads: blue where the block also writes ``out``
    (same shape: its own tile), orange around it (the halo); numbers say how often each is
    read when that is more than once."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    a = t.array(name)
    b = _block_id(t, block)
    own = np.zeros(0, np.int64)
    if out is not None:
        if t.array(out).shape != a.shape:
            raise ValueError(f"halo: {out} {t.array(out).shape} and {name} {a.shape} differ")
        own = np.unique(t.accesses(out, WRITE, block=b)["index"])
    r = t.accesses(name, READ, block=b)
    count = np.bincount(r["index"], minlength=a.size)
    read = np.flatnonzero(count)
    ring = np.setdiff1d(read, own)
    ax = _axes(ax, a.shape, None)
    _background(ax, a.shape, None)
    vals = np.full(a.size, np.nan)
    vals[read] = 1.0
    vals[np.intersect1d(read, own)] = 0.0
    _mesh(ax, _to2d(vals, a.shape, None), ListedColormap(["#6f9fd8", "#f0a35e"]), 0, 1)
    unread_own = np.setdiff1d(own, read)
    if unread_own.size:
        _hatch(ax, a.shape, None, unread_own, edgecolor="#6f9fd8", linewidth=1.2)
    if count.max(initial=0) > 1:
        _labels(ax, a.shape, None, read, [str(c) for c in count[read]])
    handles = [Patch(color="#f0a35e", label=f"halo: read only ({ring.size})")]
    if out is not None:
        handles.insert(0, Patch(color="#6f9fd8", label=f"read, and {out} written here "
                                                       f"({np.intersect1d(read, own).size})"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0),
              frameon=False)
    head = title or (f"{t.kernel}: block {block} reads {read.size} elements of {name} "
                     f"({r.size} reads)" + (f" to write {own.size} of {out}" if out else ""))
    _frame(ax, a.shape, None, head)
    return ax


# ============================================================================ flow
def flow(t: Trace, src: str, dst: str, threads: Iterable[int] | None = None, *, ax=None,
         wrap: int | None = None, title: str | None = None):
    """Arrows from the elements of ``src`` each thread reads to the element of ``dst`` it
    writes next (in the thread's program order), one colour per thread (``threads``: global
    ids; default the first 32 threads that write ``dst``)."""
    plt = _plt()
    from matplotlib.patches import ConnectionPatch

    s, d = t.array(src), t.array(dst)
    acc = t.acc[((t.acc["array"] == s.id) & (t.acc["kind"] == READ)) |
                ((t.acc["array"] == d.id) & (t.acc["kind"] == WRITE))]      # program order
    gid = t.gid(acc["block"], acc["thread"])
    writes = acc["array"] == d.id
    sel = list(threads) if threads is not None else \
        list(dict.fromkeys(gid[writes].tolist()))[:32]
    side = len(s.shape) == 2 or len(d.shape) == 2
    if ax is None:
        shp = (1, 2) if side else (2, 1)
        fig, axs = plt.subplots(*shp, figsize=(11, 5) if side else (11, 3.2))
    else:
        axs = ax
        fig = axs[0].figure
    cmap = _categorical(len(sel)) if len(sel) <= 20 else plt.cm.turbo
    for axi, arr in ((axs[0], s), (axs[1], d)):
        _background(axi, arr.shape, wrap)
        _frame(axi, arr.shape, wrap, arr.name)
    for k, g in enumerate(sel):
        color = cmap(k if len(sel) <= 20 else k / max(len(sel) - 1, 1))
        pending: list[int] = []     # src elements read since this thread's last write
        for row, is_w in zip(acc[gid == g], writes[gid == g]):
            e = int(row["index"])
            arr, axi = (d, axs[1]) if is_w else (s, axs[0])
            (xc,), (yc,) = _cell_xy(arr.shape, wrap, [e])
            axi.add_patch(plt.Rectangle((xc, yc), 1, 1, color=color, alpha=0.85))
            if not is_w:
                pending.append(e)
                continue
            for i in dict.fromkeys(pending):
                (x0,), (y0,) = _cell_xy(s.shape, wrap, [i])
                fig.add_artist(ConnectionPatch((x0 + 0.5, y0 + 0.5), (xc + 0.5, yc + 0.5),
                                               "data", "data", axesA=axs[0], axesB=axs[1],
                                               arrowstyle="->", color=color, lw=0.8,
                                               alpha=0.8))
            pending = []
    fig.suptitle(title or f"{t.kernel}: what {len(sel)} threads read from {src} (left) and "
                          f"write to {dst} (right), one colour per thread", fontsize=9)
    return axs


# ============================================================================ one warp request
def _request(t: Trace, name: str, kind, block, warp: int, line: int | None, occ: int):
    b = _block_id(t, block) or 0
    q = requests(t, name, kind, block=b, warp=warp, line=line)
    if q.size == 0:
        raise ValueError(f"warp {warp} of block {block} makes no {kind} of {name}"
                         + (f" on line {line}" if line is not None else ""))
    sites = np.unique(q["site"])
    if sites.size > 1:
        lines = sorted({t.sites[int(s)].line for s in sites})
        if len(lines) > 1:
            raise ValueError(f"{name} is accessed on lines {lines}: pass line=")
    q = q[q["occ"] == occ] if (q["occ"] == occ).any() else q[:1]
    req = q[0]
    acc = t.accesses(name, kind, block=b)
    acc = acc[(acc["thread"] // 32 == warp) & (acc["site"] == req["site"]) &
              (acc["occ"] == req["occ"])]
    return req, acc


def sectors(t: Trace, name: str, *, block=0, warp: int = 0, kind: str = "read",
            line: int | None = None, occ: int = 0, row_sectors: int = 8, ax=None,
            title: str | None = None):
    """One warp-wide global access (its ``occ``-th at that line): the elements each lane
    touches, coloured by lane, on rows of ``row_sectors`` 32-byte sectors. Sectors the request
    fetches are shaded; only rows holding a touched sector are drawn."""
    plt = _plt()
    a = t.array(name)
    req, acc = _request(t, name, kind, block, warp, line, occ)
    per = max(SECTOR // a.itemsize, 1)                 # elements per sector
    cols = per * row_sectors
    idx = acc["index"]
    sec = np.unique(idx * a.itemsize // SECTOR)
    rows = np.unique(idx // cols)
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 0.42 * rows.size * 11 / cols * 2.2 + 1.3))
    cw = 1.0
    pos = {r: k for k, r in enumerate(rows)}
    lane_c = plt.cm.viridis
    for k, rr in enumerate(rows):
        for j in range(row_sectors):
            sid = (rr * cols + j * per) * a.itemsize // SECTOR
            hit = sid in set(sec.tolist())
            ax.add_patch(plt.Rectangle((j * per, k), per, 1, facecolor="#ffd9a8" if hit else
                                       "white", edgecolor="black", lw=1.2))
    for e, th in zip(idx, acc["thread"]):
        k, c = pos[e // cols], e % cols
        ax.add_patch(plt.Rectangle((c + 0.06, k + 0.12), cw - 0.12, 0.76,
                                   color=lane_c((th % 32) / 31), alpha=0.9))
        ax.text(c + 0.5, k + 0.5, str(th % 32), ha="center", va="center",
                fontsize=6 if cols <= 64 else 4.5, color="white" if th % 32 < 20 else "black")
    ax.set_xlim(0, cols)
    ax.set_ylim(rows.size, 0)
    ax.set_yticks(np.arange(rows.size) + 0.5, [f"{name}[{r * cols}]" for r in rows],
                  fontsize=7)
    ax.set_xticks(np.arange(0, cols + 1, per), [f"+{c * a.itemsize} B" for c in
                                                range(0, cols + 1, per)], fontsize=6)
    ax.tick_params(length=0)
    for sp in ax.spines.values():
        sp.set_visible(False)
    s = t.sites[int(req["site"])]
    ax.set_title(title or (
        f"{t.kernel}: warp {warp} of block {block}, {kind} of {s.expr} (line {s.line}): "
        f"{req['lanes']} lanes use {req['bytes']} B in {req['sectors']} sectors of 32 B "
        f"(ideal {req['ideal']})\nnumbers: lane; shaded: sectors fetched; one row = "
        f"{row_sectors} sectors = {cols * a.itemsize} B"), fontsize=9)
    return ax


def banks(t: Trace, name: str, *, block=0, warp: int = 0, kind: str = "read",
          line: int | None = None, occ: int = 0, ax=None, title: str | None = None):
    """One warp-wide shared-memory access: the array's cells tinted by their bank (4-byte
    words, 32 banks), the cells the warp touches marked with their lane, and below, the number
    of distinct words each bank must serve: the tallest bar is the number of wavefronts."""
    plt = _plt()
    a = t.array(name)
    if a.space != "shared":
        raise ValueError(f"{name} is {a.space} memory; banks are a shared-memory notion")
    req, acc = _request(t, name, kind, block, warp, line, occ)
    shape = a.shape if len(a.shape) == 2 else (a.size,)
    wrap = None if len(shape) == 2 else BANKS * WORD // a.itemsize
    if ax is None:
        rows, cols = _shape2d(shape, wrap)
        cell = min(0.3, 10.0 / cols, 6.5 / rows)
        fig, (ax, ax2) = plt.subplots(2, 1, figsize=(cols * cell + 1.8, rows * cell + 3.2),
                                      gridspec_kw=dict(height_ratios=[rows * cell, 1.6]))
    else:
        ax, ax2 = ax
    bank = (np.arange(a.size) * a.itemsize // WORD) % BANKS
    _mesh(ax, _to2d(bank.astype(float), shape, wrap), plt.cm.hsv, 0, BANKS)
    rows, cols = _shape2d(shape, wrap)
    ax.add_patch(plt.Rectangle((0, 0), cols, rows, color="white", alpha=0.62, lw=0))
    idx = acc["index"]
    x, y = _cell_xy(shape, wrap, idx)
    for xi, yi, e in zip(x, y, idx):
        ax.add_patch(plt.Rectangle((xi, yi), 1, 1, color=plt.cm.hsv(bank[e] / BANKS),
                                   ec="black", lw=1.0))
    _labels(ax, shape, wrap, idx, [str(th % 32) for th in acc["thread"]], min_size=3.0)
    s = t.sites[int(req["site"])]
    dims = "x".join(str(v) for v in a.shape)
    _frame(ax, shape, wrap, title or (
        f"{t.kernel}: {name} ({dims}), tint = bank; warp {warp} {kind}s {s.expr} "
        f"(line {s.line}), numbers = lanes"))
    words = np.unique(idx * a.itemsize // WORD)
    per_bank = np.bincount(words % BANKS, minlength=BANKS)
    ax2.bar(np.arange(BANKS), per_bank, color=[plt.cm.hsv(k / BANKS) for k in range(BANKS)],
            edgecolor="black", lw=0.5)
    ax2.set_xlim(-0.6, BANKS - 0.4)
    ax2.set_xticks(range(0, BANKS, 4))
    ax2.set_xlabel("bank", fontsize=7)
    ax2.set_ylabel("distinct words", fontsize=7)
    ax2.tick_params(labelsize=7)
    ax2.yaxis.get_major_locator().set_params(integer=True)
    deg = int(per_bank.max())
    ax2.set_title(f"{deg} wavefront{'s' if deg > 1 else ''}: "
                  + ("conflict-free" if deg == 1 else f"a {deg}-way bank conflict"), fontsize=9)
    return ax, ax2


# ============================================================================ phases
def phases(t: Trace, name: str, block=0, *, ax=None, title: str | None = None,
           arrows: bool = True):
    """A shared array between barriers, one row per phase: cells written in that phase,
    coloured by the writer's warp, with an arrow from each element a writer reads (in the row
    above, where its value comes from) to the element it writes. The right margin says how
    many threads and warps were busy: the reduction tree, and its divergence."""
    plt = _plt()
    from matplotlib.patches import FancyArrowPatch

    a = t.array(name)
    b = _block_id(t, block) or 0
    r = t.accesses(name, None, block=b)
    w = r[r["kind"] != READ]
    ph = np.unique(w["phase"])
    n = a.size
    if ax is None:
        _, ax = plt.subplots(figsize=(12, 0.5 * ph.size + 1.2))
    nwarps = -(-t.nthreads // 32)
    cmap = _categorical(nwarps)
    for k, p in enumerate(ph):
        wp = w[w["phase"] == p]
        for e, th in zip(wp["index"], wp["thread"]):
            ax.add_patch(plt.Rectangle((e, k + 0.25), 1, 0.5, color=cmap(int(th // 32))))
        busy = np.unique(wp["thread"])
        nw = np.unique(busy // 32).size
        ax.text(n + n * 0.01, k + 0.5, f"{busy.size} thread{'s' * (busy.size > 1)} in {nw} "
                                       f"warp{'s' * (nw > 1)}", va="center", fontsize=7)
        if not arrows or k == 0:
            continue
        rp = r[(r["phase"] == p) & (r["kind"] == READ)]
        for th in busy:
            dst = wp["index"][wp["thread"] == th]
            for src in np.unique(rp["index"][rp["thread"] == th]):
                for d in dst:
                    if src == d:
                        continue
                    ax.add_patch(FancyArrowPatch((src + 0.5, k - 0.25), (d + 0.5, k + 0.25),
                                                 arrowstyle="-|>", mutation_scale=5, lw=0.5,
                                                 color="#444444", alpha=0.7))
    ax.set_xlim(0, n)
    ax.set_ylim(ph.size, 0)
    ax.set_yticks(np.arange(ph.size) + 0.5, [f"phase {p}" for p in ph], fontsize=7)
    ticks = np.linspace(0, n, 9).astype(int)
    ax.set_xticks(ticks + 0.5, [str(v) for v in ticks], fontsize=7)
    ax.set_xlabel(f"{name} index", fontsize=7)
    ax.tick_params(length=0)
    for sp in ax.spines.values():
        sp.set_visible(False)
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=cmap(i), label=f"warp {i}") for i in range(nwarps)],
              fontsize=6, ncol=min(nwarps, 8), loc="upper center",
              bbox_to_anchor=(0.5, -0.25 / max(ph.size, 1) ** 0.5), frameon=False)
    ax.set_title(title or f"{t.kernel}: {name} in block {block}, one row per barrier phase "
                          "(cells written, coloured by warp; arrows: the values added in)",
                 fontsize=9)
    return ax
