#!/usr/bin/env python3
"""Draw _static/figures/mbarrier_ring.svg: the full and empty mbarriers of a 3-stage ring over two
laps, who arrives on which barrier, who waits, and on which parity (Chapter 8, "The Hopper
primitives"). A conceptual diagram: the times are made up to show the order of events, nothing
is measured.

    python tools/figures/mbarrier_ring.py          rewrites the SVG (deterministic output)

The schedule follows hgemm.cu's gemm_tma_ws (and attention_forward.cu's flash_wgmma): iteration
``it`` uses stage ``s = it % STAGES`` for the ``lap = it // STAGES``-th time. The producer waits on
``empty[s]`` with parity ``(lap - 1) & 1`` (no wait on lap 0), arrives with expect_tx on
``full[s]`` and issues the TMA copies, whose bytes complete the phase. The consumers wait on
``full[s]`` with parity ``lap & 1`` and, once their wgmma no longer read the stage, arrive on
``empty[s]`` (two consumer warpgroups: an arrival count of 2).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "_static" / "figures" / "mbarrier_ring.svg"

STAGES, ITERS = 3, 6                      # two laps of a 3-stage ring
ISSUE_GAP, TMA, MMA = 0.5, 1.0, 1.0       # made-up durations (time units), only for the order
PARITY_COLOR = {0: "#d6e6f5", 1: "#fbdcc0"}
PRODUCER, CONSUMER = "#a23b2a", "#1f4e79"


def schedule() -> dict[str, list[float]]:
    """Event times of each iteration: producer issue, bytes landed, consumer start, release."""
    issue, land, start, release = [], [], [], []
    for it in range(ITERS):
        t = 0.0 if it == 0 else issue[-1] + ISSUE_GAP
        if it >= STAGES:                  # the producer waits until the stage was released
            t = max(t, release[it - STAGES])
        issue.append(t)
        land.append(t + TMA)
        s = land[-1] if it == 0 else max(land[-1], start[-1] + MMA)
        start.append(s)
        release.append(s + MMA)           # wgmma done reading the stage: arrive on empty[s]
    return {"issue": issue, "land": land, "start": start, "release": release}


def phase_lane(ax, y: float, label: str, completions: list[float], t_end: float) -> None:
    """A barrier's phases along time: one band per phase, coloured by its parity."""
    edges = [0.0, *completions, t_end]
    for k, (a, b) in enumerate(zip(edges, edges[1:])):
        ax.add_patch(Rectangle((a, y - 0.22), b - a, 0.44, fc=PARITY_COLOR[k % 2], ec="0.55",
                               lw=0.6))
        ax.text((a + b) / 2, y, f"phase {k}", ha="center", va="center", fontsize=9, color="0.3")
    for t in completions:
        ax.plot([t, t], [y - 0.3, y + 0.3], color="k", lw=2)
    ax.text(-0.12, y, label, ha="right", va="center", fontsize=11, family="monospace")


def draw() -> plt.Figure:
    ev = schedule()
    t_end = ev["release"][-1] + 0.7
    fig, ax = plt.subplots(figsize=(10, 8.4))
    y_prod, y_cons = 10.4, 1.2
    y_full = {s: 9.0 - 0.95 * s for s in range(STAGES)}
    y_empty = {s: 5.0 - 0.95 * s for s in range(STAGES)}

    # lanes: full[s] completes when the TMA bytes of that stage's use have landed, empty[s] when
    # both consumer warpgroups have arrived
    for s in range(STAGES):
        uses = [it for it in range(ITERS) if it % STAGES == s]
        phase_lane(ax, y_full[s], f"full[{s}]", [ev["land"][it] for it in uses], t_end)
        phase_lane(ax, y_empty[s], f"empty[{s}]", [ev["release"][it] for it in uses], t_end)

    for it in range(ITERS):
        s, lap = it % STAGES, it // STAGES
        ti, tc, tr = ev["issue"][it], ev["start"][it], ev["release"][it]
        # producer: (wait on empty[s]) -> arrive.expect_tx on full[s] -> TMA copies
        ax.add_patch(Rectangle((ti, y_prod - 0.36), 0.44, 0.72, fc=PRODUCER, ec="k", lw=0.5))
        ax.text(ti + 0.22, y_prod, f"it {it}\ns{s}", ha="center", va="center", fontsize=8,
                color="white")
        ax.plot([ti], [y_full[s] + 0.34], marker="v", ms=8, color=PRODUCER)
        ax.annotate("", xy=(ti, y_full[s] + 0.44), xytext=(ti + 0.22, y_prod - 0.38),
                    arrowprops=dict(arrowstyle="->", color=PRODUCER, lw=0.8, alpha=0.45))
        if lap > 0:   # the producer's wait on empty[s], parity (lap - 1) & 1
            p = (lap - 1) & 1
            ax.plot([ti], [y_empty[s] + 0.36], marker="o", ms=7.5, mfc="white", mec=PRODUCER,
                    mew=1.8)
            ax.text(ti + 0.1, y_empty[s] + 0.4, f"wait p{p}", fontsize=9, color=PRODUCER,
                    va="center")
            ax.annotate("", xy=(ti + 0.22, y_prod - 0.38), xytext=(ti, y_empty[s] + 0.46),
                        arrowprops=dict(arrowstyle="->", color=PRODUCER, lw=0.9, ls="--",
                                        alpha=0.45))
        # consumers: wait on full[s] with parity lap & 1, multiply, arrive on empty[s]
        ax.plot([tc], [y_full[s] - 0.36], marker="o", ms=7.5, mfc="white", mec=CONSUMER, mew=1.8)
        ax.text(tc + 0.1, y_full[s] - 0.4, f"wait p{lap & 1}", fontsize=9, color=CONSUMER,
                va="center")
        ax.add_patch(Rectangle((tc, y_cons - 0.4), tr - tc, 0.8, fc=CONSUMER,
                               alpha=0.55 + 0.3 * lap, ec="k", lw=0.5))
        ax.text((tc + tr) / 2, y_cons, f"it {it}\ns{s}, lap {lap}", ha="center", va="center",
                fontsize=8.5, color="white")
        ax.plot([tr], [y_empty[s] - 0.34], marker="^", ms=8, color=CONSUMER)
        ax.annotate("", xy=(tr, y_empty[s] - 0.44), xytext=(tr, y_cons + 0.42),
                    arrowprops=dict(arrowstyle="->", color=CONSUMER, lw=0.8, alpha=0.45))
    ax.text(-0.12, y_prod, "producer\n(1 thread)", ha="right", va="center", fontsize=10)
    ax.text(-0.12, y_cons, "consumers:\nwgmma", ha="right", va="center", fontsize=10)

    legend = [
        ("v", PRODUCER, "producer: expect_tx + TMA on full[s]"),
        ("o", PRODUCER, "producer: wait empty[s], parity (lap-1)%2"),
        ("o", CONSUMER, "consumers: wait full[s], parity lap%2"),
        ("^", CONSUMER, "consumers: arrive on empty[s] (x2)"),
    ]
    for i, (m, c, text) in enumerate(legend):
        x, y = -1.75 + 4.9 * (i % 2), 12.15 - 0.45 * (i // 2)
        if m == "o":
            ax.plot([x], [y], marker=m, ms=7.5, mfc="white", mec=c, mew=1.8)
        else:
            ax.plot([x], [y], marker=m, ms=8, color=c)
        ax.text(x + 0.17, y, text, va="center", fontsize=9.5)
    for i, (k, text) in enumerate([(0, "current phase has parity 0"),
                                   (1, "current phase has parity 1")]):
        x, y = -1.82 + 4.9 * i, 11.25
        ax.add_patch(Rectangle((x, y - 0.14), 0.3, 0.28, fc=PARITY_COLOR[k], ec="0.55", lw=0.6))
        ax.text(x + 0.4, y, text + ("; black tick: a phase completes" if k else ""),
                va="center", fontsize=9.5)
    ax.annotate("", xy=(t_end, 0.45), xytext=(0, 0.45),
                arrowprops=dict(arrowstyle="->", color="0.4", lw=0.8))
    ax.text(t_end, 0.5, "time (not to scale)", ha="right", va="bottom", fontsize=9,
            color="0.4")
    ax.set_xlim(-1.9, t_end + 0.05)
    ax.set_ylim(0.3, 12.45)
    ax.axis("off")
    ax.set_title("A 3-stage TMA ring over two laps: who arrives, who waits, on which parity",
                 fontsize=12)
    fig.tight_layout()
    return fig


def main() -> None:
    plt.rcParams["svg.hashsalt"] = "mbarrier_ring"   # stable ids: the same SVG on every run
    plt.rcParams["svg.fonttype"] = "none"            # text stays text (small, searchable)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig = draw()
    fig.savefig(OUT, format="svg", metadata={"Date": None})
    plt.close(fig)
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
