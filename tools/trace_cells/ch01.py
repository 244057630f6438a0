# ruff: noqa: F821, E402  (cells of a notebook: np, cb, plt come from its setup cells)
# Drawings of cb.trace for lessons/01_first_kernel.ipynb (percent format: tools/nbtools.py from-py).
# Where they go:
#   cells 1-4 ("Who touched what" ... the short grid)  after the who_am_i figure cell, in
#             "## Threads, blocks and the grid" (they draw the real vector_add_v1, and the gap a
#             grid rounded down leaves)
#   cells 5-6 ("The grid-stride loop, traced")         in "## A grid of any size: the grid-stride
#             loop", after the cell that shows vector_add_v2's source
# Every cell runs under the simulator (cb.trace always does, in a subprocess), a few seconds each.

# %% [markdown]
# **Who touched what, from the kernel itself.** The figure above was drawn from values the kernel
# stored on purpose. `cb.trace` needs no such help: it runs a Numba kernel on the CUDA simulator
# (in a separate process, so it works next to a GPU too) and records every element each thread
# reads and writes. Here is `vector_add_v1` on 200 elements with 64 threads per block: each
# element of `z` is coloured by the block that wrote it and labelled with the writer's
# `threadIdx.x`. Four blocks make 256 threads; the title counts those the bounds guard kept idle.

# %%
from cudabook import tracedraw as td

tr_n = 200
tr_x = np.arange(tr_n, dtype=np.float32)
tr_y = np.ones(tr_n, np.float32)
tr_z = np.full(tr_n, np.nan, np.float32)
tr_va = cb.load_numba("vector_add")
tr_v1 = cb.trace(tr_va.vector_add_v1, cb.ceil_div(tr_n, 64), 64, tr_x, tr_y, tr_z)
print(tr_v1)
print(tr_v1.findings())
td.writers(tr_v1, "z", by="block")
plt.show()

# %% [markdown]
# The record also shows what goes wrong. Round the block count down instead of up (`n // 64`
# blocks) and the tail of `z` is never written: hatched in the drawing, and named by
# `findings()`, the check behind the graders' messages.

# %%
tr_short = cb.trace(tr_va.vector_add_v1, tr_n // 64, 64, tr_x, tr_y, tr_z)
print(tr_short.findings())
td.writers(tr_short, "z", by="block")
plt.show()

# %% [markdown]
# **The grid-stride loop, traced.** Two blocks of 32 threads, 64 threads in all, cover the same
# 200 elements. Drawn in rows of 64, every column belongs to one thread (the number is its global
# index, the colour too): it starts at its index and steps down the column by the grid size,
# 64, until it passes the end. The count below says how many elements each thread handled.

# %%
tr_n = 200
tr_x = np.arange(tr_n, dtype=np.float32)
tr_y = np.ones(tr_n, np.float32)
tr_va = cb.load_numba("vector_add")
tr_v2 = cb.trace(tr_va.vector_add_v2, 2, 32, tr_x, tr_y, np.full(tr_n, np.nan, np.float32))
tr_w = tr_v2.accesses("z", "write")
print("elements per thread:", np.bincount(tr_v2.gid(tr_w["block"], tr_w["thread"])))
td.writers(tr_v2, "z", by="thread", label="thread", wrap=64)
plt.show()
