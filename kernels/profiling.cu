// profiling.cu: the instruments of Chapter 5 (profiling), not an op ladder.
//
// kernels
//   spin             one thread busy-waits `cycles` SM clock cycles: a kernel whose duration is
//                    known before it runs (the timing traps of the lesson, the ex05.4 grader)
//   occupancy_probe  keeps PROBE_LIVE accumulators alive per thread and PROBE_SMEM bytes of
//                    static shared memory: compiled with -maxrregcount=R it uses R registers, so
//                    a sweep can ask the driver for the occupancy of any (registers, shared
//                    memory, block size) and compare it with cudabook.occupancy
//
// Both are compiled by cudabook.load_cuda("profiling", options=("-DPROBE_LIVE=...", ...)).

// launch: grid 1, block 1 (more threads spin in parallel and change nothing)
// clock64() counts the cycles of the SM the thread runs on; at f MHz, cycles / f microseconds.
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}

#ifndef PROBE_LIVE
#define PROBE_LIVE 32
#endif
#ifndef PROBE_SMEM
#define PROBE_SMEM 0
#endif

// launch: any grid and block; out holds gridDim.x * blockDim.x floats. Launched for real only
// by the tests: the sweep only asks the driver how many blocks would fit.
// Each step updates every accumulator from its neighbour, so all PROBE_LIVE stay live at once
// and the compiler needs that many registers (or spills what -maxrregcount does not allow).
extern "C" __global__ void occupancy_probe(float* out, int iters) {
#if PROBE_SMEM >= 4
    __shared__ float pad[PROBE_SMEM / 4];
    pad[threadIdx.x % (PROBE_SMEM / 4)] = (float)threadIdx.x;
    __syncthreads();
#endif
    float acc[PROBE_LIVE];
#pragma unroll
    for (int j = 0; j < PROBE_LIVE; ++j) acc[j] = (float)(threadIdx.x * (j + 1));
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int j = 0; j < PROBE_LIVE; ++j) acc[j] = acc[j] * 0.999f + acc[(j + 1) % PROBE_LIVE];
    }
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < PROBE_LIVE; ++j) s += acc[j];
#if PROBE_SMEM >= 4
    s += pad[(threadIdx.x + 1) % (PROBE_SMEM / 4)];
#endif
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
