# ruff: noqa: F821, E402  (cells of a notebook: np, cb, plt come from its setup cells)
# Drawings of cb.trace for lessons/04_tiling.ipynb (percent format: tools/nbtools.py from-py).
# Where they go:
#   cells 1-2 ("Who loads which tile element")  in "## v3: shared-memory tiles", after the cell
#             that checks the Numba twin of v3 (matmul_smem16 in kernels/matmul.py)
# The cell runs under the simulator (cb.trace always does, in a subprocess), about 3 s.

# %% [markdown]
# **Who loads which tile element.** `matmul_smem16`, the Numba twin of this step (16 × 16 tiles),
# traced on a 32 × 48 by 48 × 32 product: 2 × 2 blocks, three tile steps along K. First: the
# elements of A that block (0, 1) reads, coloured by the barrier phase in which it reads them
# (two barriers per step, so phases 0, 2, 4): a band of 16 rows, one 16 × 16 tile per step, and
# nothing else of A. Second: the tile of A in shared memory during the first step, each element
# labelled with the thread (`threadIdx.x, threadIdx.y`) that loaded it and coloured by that
# thread's warp. Thread (x, y) loads `As[y, x]`, so a warp, two rows of 16 threads, loads two
# 64-byte pieces of two rows of A. The table counts the sectors of each global request and the
# passes of each shared-memory read, and the findings confirm both barriers are where they must
# be.

# %%
from cudabook import tracedraw as td
from cudabook import tracemem

tr_mm = cb.load_numba("matmul")
tr_m = cb.trace(tr_mm.matmul_smem16, (2, 2), (16, 16), np.ones((32, 48), np.float32),
                np.ones((48, 32), np.float32), np.zeros((32, 32), np.float32))
print(tracemem.summary(tr_m))
print(tr_m.findings())
td.reads(tr_m, "A", by="phase", block=(0, 1))
plt.show()
td.writers(tr_m, "As", by="warp", label="local", block=(0, 1), phase=0)
plt.show()
