#!/usr/bin/env python3
"""Shows the bank conflicts that padding removes: launches transpose_v1..v3 of kernels/transpose.cu
once each, for Nsight Compute (Chapter 2).

    ncu --kernel-name regex:transpose_v \\
        --metrics l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,\\
l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,dram__bytes.sum,gpu__time_duration.sum \\
        python tools/dev/ch02_ncu_transpose.py

transpose_v2 (tile[32][32]) should show shared-memory load bank conflicts, transpose_v3
(tile[32][33]) none.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402
import numpy as np  # noqa: E402

import cudabook as cb  # noqa: E402

M = 4096
mod = cb.load_cuda("transpose")
a = cupy.random.standard_normal((M, M), dtype=cupy.float32)
out = cupy.empty_like(a)
for v in (1, 2, 3):
    mod.get(f"transpose_v{v}")((M // 32, M // 32), (32, 8), (a, out, np.int32(M), np.int32(M)))
    cupy.cuda.Device().synchronize()
    assert bool(cupy.array_equal(out, a.T)), f"transpose_v{v} is wrong"
print("launched transpose_v1, v2, v3 on", M, "x", M)
