"""Launch CUDA C++ matmul_v5 and Numba matmul_v5 / v6 once each at n = 2048, for Nsight Compute:

    ncu --kernel-name regex:matmul_v[56] --section SpeedOfLight --section WarpStateStats \
        --section InstructionStats python tools/dev/ch04_ncu_numba.py
"""

import cupy as cp
from numba import cuda

import cudabook as cb

mm = cb.load_numba("matmul")
mod = cb.load_cuda("matmul")
n = 2048
A = cp.random.rand(n, n, dtype=cp.float32)
B = cp.random.rand(n, n, dtype=cp.float32)
C = cp.empty((n, n), cp.float32)
mm.launch_cupy(mod, "v5", A, B, C)
dA, dB, dC = (cuda.as_cuda_array(x) for x in (A, B, C))
for v in ("v5", "v6"):
    mm.launch_numba(v, dA, dB, dC)
cp.cuda.Device().synchronize()
print("launched")
