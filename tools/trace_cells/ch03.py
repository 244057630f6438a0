# ruff: noqa: F821, E402  (cells of a notebook: np, cb, plt come from its setup cells)
# Drawings of cb.trace for lessons/03_building_blocks.ipynb (percent format: tools/nbtools.py
# from-py). Where they go:
#   cells 1-2 ("The two trees, traced")  in "## Reductions: the ladder", after the markdown cell
#             "The ladder, one change at a time" (v1 -> v2 is the first step it describes)
#   cells 3-4 ("What one block reads")   in "## Convolution", after the markdown cell that
#             describes v1, v2 and v3 (before cb.show_source("conv.cu", "conv2d_v2"))
# Every cell runs under the simulator (cb.trace always does, in a subprocess), a few seconds each.

# %% [markdown]
# **The two trees, traced.** One block of 256 threads of `reduce_v1` and of `reduce_v2`, recorded
# by `cb.trace` and drawn one row per barrier phase: the cells of the shared array `s` written in
# that phase, coloured by the writer's warp, with an arrow from each value a thread adds in. The
# right margin counts the busy threads and the warps they occupy. Interleaved addressing (v1)
# keeps every warp busy with fewer and fewer active lanes, and a warp costs the same time with 1
# active lane as with 32; sequential addressing (v2) packs the active threads into the fewest
# warps, so whole warps finish early. Both trees are race-free: every level reads only what an
# earlier phase wrote.

# %%
from cudabook import tracedraw as td

tr_rd = cb.load_numba("reduce")
for v in (1, 2):
    tr_r = cb.trace(getattr(tr_rd, f"reduce_v{v}"), 1, 256, np.ones(256, np.float32),
                    np.zeros(1, np.float32))
    print(f"reduce_v{v}: partial sum {tr_r.array('partial').after[0]:.0f}; {tr_r.findings()!r}")
    td.phases(tr_r, "s")
    plt.show()

# %% [markdown]
# **What one block reads.** Block (1, 1) of a 40 × 40 image with a 5 × 5 filter, traced for both
# kernels. Blue: the 16 × 16 pixels whose outputs the block writes; orange: the halo, the extra
# K − 1 rows and columns around them that it needs too. In v1 every thread reads its own K × K
# window from global memory, so the numbers (reads of each pixel by this block alone) climb to
# K² in the middle; the titles give the total. v2 reads each pixel of tile and halo once into
# shared memory, and the K² reads per output go to shared memory instead.

# %%
from cudabook import tracedraw as td

tr_cv = cb.load_numba("conv")
tr_img = np.ones((40, 40), np.float32)
tr_w = np.ones((5, 5), np.float32)
for name in ("conv2d_v1", "conv2d_v2"):
    tr_c = cb.trace(getattr(tr_cv, name), (3, 3), (16, 16), tr_img, tr_w, np.zeros_like(tr_img))
    td.halo(tr_c, "x", (1, 1), out="y")
    plt.show()
