"""Shows why Numba's register-tiled matmul trails CUDA C++ v5: launches CUDA matmul_v5 and the
Numba matmul_reg8x8 / matmul_reg8x8_prefetch once each at n = 2048, for Nsight Compute.

    ncu --kernel-name regex:matmul_ --section SpeedOfLight --section WarpStateStats \\
        --section InstructionStats python tools/dev/ch04_ncu_numba.py
"""

import cupy as cp
from numba import cuda

import cudabook as cb

ml = cb.load_launch("matmul")
mod = cb.load_cuda("matmul")
n = 2048
A = cp.random.rand(n, n, dtype=cp.float32)
B = cp.random.rand(n, n, dtype=cp.float32)
C = cp.empty((n, n), cp.float32)
ml.launch_cupy(mod, "v5", A, B, C)
dA, dB, dC = (cuda.as_cuda_array(x) for x in (A, B, C))
for v in ("reg8x8", "reg8x8_prefetch"):
    ml.launch_numba(v, dA, dB, dC)
cp.cuda.Device().synchronize()
print("launched")
