# ruff: noqa: F821, E402  (cells of a notebook: np, cb, plt come from its setup cells)
# Drawings of cb.trace for lessons/02_memory.ipynb (percent format: tools/nbtools.py from-py).
# Where they go:
#   cells 1-2 ("The same count, from the kernel's own loads")  in "## Coalescing", after the cell
#             that prints the sectors per warp computed from the formula (sectors_per_warp)
#   cells 3-4 ("The conflict, traced")  in "## Shared memory and bank conflicts: the transpose",
#             after the cell that prints conflict_degree for tile[32][32] and tile[32][33]
# Every cell runs under the simulator (cb.trace always does, in a subprocess), a few seconds each.

# %% [markdown]
# **The same count, from the kernel's own loads.** `cb.trace` runs `copy_strided` (and
# `copy_offset`) on the CUDA simulator and records the element every thread reads;
# `cb.tracemem` groups the 32 lanes of a warp that execute the same load and counts the 32-byte
# sectors they touch. The table agrees with the formula above. The drawing shows warp 0's load
# at stride 1 and at stride 4: each box is an element, numbered by the lane that reads it; the
# shaded sectors are the ones memory must move, used or not.

# %%
from cudabook import tracedraw as td
from cudabook import tracemem

tr_x = np.arange(64 * 32 + 1, dtype=np.float32)       # room for a stride of 32
tr_y = np.zeros(64, np.float32)
tr_cp = cb.load_numba("copy")
tr_copy = {f"stride {s}": cb.trace(tr_cp.copy_strided, 1, 64, tr_x, tr_y, s)
           for s in (1, 2, 4, 8, 32)}
tr_copy["offset 1"] = cb.trace(tr_cp.copy_offset, 1, 64, tr_x, tr_y, 1)
print("access     sectors per warp load (fewest possible)")
for name, t in tr_copy.items():
    r = tracemem.summary(t).row("x", "read")
    print(f"{name:9s}  {r['sectors']:4.0f} ({r['ideal']:.0f})")
fig, axs = plt.subplots(2, 1, figsize=(11, 5.5))
td.sectors(tr_copy["stride 1"], "x", ax=axs[0])
td.sectors(tr_copy["stride 4"], "x", ax=axs[1])
plt.tight_layout()
plt.show()

# %% [markdown]
# **The conflict, traced.** One 32 × 8 block of each transpose on a 32 × 32 matrix, recorded by
# `cb.trace`. Per source line, the tables give the sectors of each warp-wide global access and
# the passes (wavefronts) of each shared-memory access: v1's stores touch 32 sectors, the tile
# brings them to 4, and the padding takes the column read from 32 passes to 1. The pictures show
# warp 0 reading its first column of the tile, each cell tinted by its bank and the 32 cells
# read marked with their lanes: unpadded, the column has a single colour (one bank); padded to
# 33, it crosses all 32 banks.

# %%
from cudabook import tracedraw as td
from cudabook import tracemem

tr_tp = cb.load_numba("transpose")
tr_a = np.arange(32 * 32, dtype=np.float32).reshape(32, 32)
tr_tr = {v: cb.trace(getattr(tr_tp, f"transpose_v{v}"), 1, (32, 8), tr_a,
                     np.zeros((32, 32), np.float32)) for v in (1, 2, 3)}
for v, t in tr_tr.items():
    print(f"transpose_v{v}\n{tracemem.summary(t)}\n")
fig, axs = plt.subplots(2, 2, figsize=(13, 9), gridspec_kw=dict(height_ratios=[5, 1.3]))
for col, v in enumerate((2, 3)):
    line = tracemem.summary(tr_tr[v]).row("tile", "read")["line"]
    td.banks(tr_tr[v], "tile", line=line, ax=(axs[0, col], axs[1, col]))
plt.tight_layout()
plt.show()
