// ch03_emu.cpp: run every CUDA C++ kernel of Chapter 3 (kernels/{activation,reduce,softmax,
// layernorm,conv}.cu) on the CPU through ch03_emu.h and compare with float64 references.
//
//   g++ -std=c++20 -O1 -pthread -Ikernels -Itools/dev -include ch03_emu.h -x c++ \
//       tools/dev/ch03_emu.cpp -o /tmp/ch03_emu && /tmp/ch03_emu
//
// Catches logic errors (indices, -inf handling, missing barriers: the emulator runs one OS thread
// per CUDA thread), not performance or NVRTC-only compile errors (see ch03_nvrtc.py).
#include "ch03_emu.h"
#include <cstdio>
#include <random>
#include <algorithm>
#include "activation.cu"
#include "reduce.cu"
#include "softmax.cu"
#include "layernorm.cu"
#include "conv.cu"

static std::mt19937 gen(1);
static int fails = 0;
std::vector<float> randn(size_t n, float s = 1, float m = 0) { std::normal_distribution<float> d(m, s); std::vector<float> v(n); for (auto& x : v) x = d(gen); return v; }
std::vector<float> nanv(size_t n) { return std::vector<float>(n, NAN); }
void cmp(const char* name, const std::vector<float>& o, const std::vector<double>& r, double atol = 1e-5, double rtol = 1e-4) {
    int bad = 0; size_t first = 0;
    for (size_t i = 0; i < r.size(); i++) {
        bool ok = std::fabs(o[i] - r[i]) <= atol + rtol * std::fabs(r[i]) || (std::isinf(r[i]) && o[i] == r[i]);
        if (!ok) { if (!bad) first = i; bad++; }
    }
    if (bad) { fails++; printf("FAIL %s: %d wrong, first %zu: %g vs %g\n", name, bad, first, o[first], r[first]); }
    else printf("ok   %s\n", name);
}
double gelu(double z) { return 0.5 * z * (1 + std::tanh(std::sqrt(2 / M_PI) * (z + 0.044715 * z * z * z))); }

std::vector<double> softmax_ref(const std::vector<float>& x, int M, int N) {
    std::vector<double> y(x.size());
    for (int r = 0; r < M; r++) {
        double m = -INFINITY; for (int j = 0; j < N; j++) m = std::max(m, (double)x[r * N + j]);
        if (std::isinf(m)) m = 0;
        double d = 0; for (int j = 0; j < N; j++) d += std::exp(x[r * N + j] - m);
        for (int j = 0; j < N; j++) y[r * N + j] = d > 0 ? std::exp(x[r * N + j] - m) / d : 0;
    }
    return y;
}
int v5_threads(int N) { int t = (N + 15) / 16; t = (t + 31) / 32 * 32; return std::max(32, std::min(1024, t)); }

int main() {
    // activation
    { int M = 3, N = 100; auto x = randn(M * N, 3), b = randn(N); auto y = nanv(M * N), t = nanv(M * N);
      std::vector<double> r(M * N), rr(M * N);
      for (int i = 0; i < M * N; i++) { r[i] = gelu((double)x[i] + b[i % N]); rr[i] = std::max(0.f, x[i]); }
      launch({2}, {256}, [&] { relu_v1(x.data(), y.data(), M * N); }); cmp("relu_v1", y, rr);
      y = nanv(M * N); launch({2}, {256}, [&] { bias_add_v1(x.data(), b.data(), t.data(), M, N); });
      launch({2}, {256}, [&] { gelu_v1(t.data(), y.data(), M * N); }); cmp("bias_add_v1+gelu_v1", y, r);
      y = nanv(M * N); launch({2}, {256}, [&] { bias_gelu_v1(x.data(), b.data(), y.data(), M, N); }); cmp("bias_gelu_v1", y, r);
      y = nanv(M * N); launch({1}, {32}, [&] { bias_gelu_v2(x.data(), b.data(), y.data(), M, N); }); cmp("bias_gelu_v2", y, r);
      std::vector<double> re(M * N); for (int i = 0; i < M * N; i++) re[i] = 0.5 * x[i] * (1 + std::erf(x[i] / std::sqrt(2.0)));
      y = nanv(M * N); launch({2}, {256}, [&] { gelu_v2(x.data(), y.data(), M * N); }); cmp("gelu_v2", y, re); }
    // reduce
    for (int n : {1, 3, 255, 1000, 2053}) {
        auto x = randn(n); double ref = 0; for (float v : x) ref += v;
        struct V { const char* name; void (*k)(const float*, float*, int); int per; };
        for (V v : {V{"reduce_v1", reduce_v1, 1}, V{"reduce_v2", reduce_v2, 1}, V{"reduce_v3", reduce_v3, 2}, V{"reduce_v4", reduce_v4, 2}}) {
            std::vector<float> cur = x; int m = n;
            while (true) { int blocks = (m + 256 * v.per - 1) / (256 * v.per); std::vector<float> p = nanv(blocks);
                launch({(unsigned)blocks}, {256}, [&] { v.k(cur.data(), p.data(), m); });
                cur = p; m = blocks; if (blocks == 1) break; }
            char nm[64]; snprintf(nm, 64, "%s n=%d", v.name, n); cmp(nm, {cur[0]}, {ref}, 1e-4);
        }
        for (unsigned bl : {64u, 256u, 1024u}) { std::vector<float> o = {0.f};
            launch({3}, {bl}, [&] { reduce_v5(x.data(), o.data(), n); });
            char nm[64]; snprintf(nm, 64, "reduce_v5 n=%d block %u", n, bl); cmp(nm, o, {ref}, 1e-4); }
        std::vector<float> o = {-INFINITY}; double mx = *std::max_element(x.begin(), x.end());
        launch({2}, {128}, [&] { reduce_max_v5(x.data(), o.data(), n); });
        char nm[64]; snprintf(nm, 64, "reduce_max_v5 n=%d", n); cmp(nm, o, {mx}, 0, 0);
    }
    { auto x = randn(1000, 1, -50); std::vector<float> o = {-INFINITY}; double mx = *std::max_element(x.begin(), x.end());
      launch({2}, {128}, [&] { reduce_max_v5(x.data(), o.data(), 1000); }); cmp("reduce_max_v5 all negative", o, {mx}, 0, 0); }
    // softmax
    for (int N : {1, 33, 1000, 4096}) {
        int M = 5; auto x = randn(M * N, 30);
        x[0 * N + 0] = 3000; for (int j = 0; j < N; j++) x[1 * N + j] = -INFINITY;
        for (int j = 0; j < (N + 1) / 2; j++) x[2 * N + j] = -INFINITY;
        auto ref = softmax_ref(x, M, N);
        struct S { const char* name; void (*k)(const float*, float*, int, int); dim3 g, b; };
        std::vector<S> vs = {{"softmax_v1", softmax_v1, {1}, {128}}, {"softmax_v2", softmax_v2, {(unsigned)M}, {256}},
                             {"softmax_v3", softmax_v3, {2}, {128}}, {"softmax_v4", softmax_v4, {(unsigned)M}, {256}}};
        if (N % 4 == 0) vs.push_back({"softmax_v5", softmax_v5, {(unsigned)M}, {(unsigned)v5_threads(N)}});
        for (auto& v : vs) { auto y = nanv(M * N); launch(v.g, v.b, [&] { v.k(x.data(), y.data(), M, N); });
            char nm[64]; snprintf(nm, 64, "%s N=%d", v.name, N); cmp(nm, y, ref, 1e-6); }
    }
    // layernorm / rmsnorm
    for (int N : {1, 130, 1000, 4096}) {
        int M = 3; auto x = randn(M * N, 2, 100), g = randn(N, 0.3f, 1), b = randn(N);
        std::vector<double> ref(M * N), rref(M * N); float eps = 1e-5f;
        for (int r = 0; r < M; r++) { double s = 0, q = 0, ss = 0; for (int j = 0; j < N; j++) { s += x[r * N + j]; ss += (double)x[r * N + j] * x[r * N + j]; }
            double mean = s / N; for (int j = 0; j < N; j++) q += (x[r * N + j] - mean) * (x[r * N + j] - mean);
            for (int j = 0; j < N; j++) { ref[r * N + j] = (x[r * N + j] - mean) / std::sqrt(q / N + eps) * g[j] + b[j];
                rref[r * N + j] = x[r * N + j] / std::sqrt(ss / N + eps) * g[j]; } }
        auto y = nanv(M * N); launch({1}, {128}, [&] { layernorm_v1(x.data(), g.data(), b.data(), y.data(), M, N, eps); });
        char nm[64]; snprintf(nm, 64, "layernorm_v1 N=%d", N); cmp(nm, y, ref, 1e-3, 1e-3);
        for (unsigned bl : {64u, 256u, 512u}) { y = nanv(M * N); launch({(unsigned)M}, {bl}, [&] { layernorm_v2(x.data(), g.data(), b.data(), y.data(), M, N, eps); });
            snprintf(nm, 64, "layernorm_v2 N=%d T=%u", N, bl); cmp(nm, y, ref, 1e-3, 1e-3); }
        y = nanv(M * N); launch({(unsigned)M}, {256}, [&] { rmsnorm_v1(x.data(), g.data(), y.data(), M, N, eps); });
        snprintf(nm, 64, "rmsnorm_v1 N=%d", N); cmp(nm, y, rref, 1e-5, 1e-4);
        if (N % 4 == 0) {
            y = nanv(M * N); launch({(unsigned)M}, {(unsigned)v5_threads(N)}, [&] { layernorm_v3(x.data(), g.data(), b.data(), y.data(), M, N, eps); });
            snprintf(nm, 64, "layernorm_v3 N=%d", N); cmp(nm, y, ref, 1e-3, 1e-3);
            y = nanv(M * N); launch({(unsigned)M}, {(unsigned)v5_threads(N)}, [&] { rmsnorm_v2(x.data(), g.data(), y.data(), M, N, eps); });
            snprintf(nm, 64, "rmsnorm_v2 N=%d", N); cmp(nm, y, rref, 1e-5, 1e-4);
        }
    }
    // conv
    { int N = 300, K = 7; auto x = randn(N), w = randn(K); auto y = nanv(N); std::vector<double> r(N);
      for (int i = 0; i < N; i++) { double a = 0; for (int k = 0; k < K; k++) { int j = i + k - K / 2; if (j >= 0 && j < N) a += (double)x[j] * w[k]; } r[i] = a; }
      launch({2}, {256}, [&] { conv1d_v1(x.data(), w.data(), y.data(), N, K); }); cmp("conv1d_v1", y, r); }
    for (int K : {1, 3, 5, 7}) { int H = 19, W = 35; auto x = randn(H * W), w = randn(K * K); std::vector<double> r(H * W);
      for (int i = 0; i < H; i++) for (int j = 0; j < W; j++) { double a = 0; for (int p = 0; p < K; p++) for (int q = 0; q < K; q++) {
          int ii = i + p - K / 2, jj = j + q - K / 2; if (ii >= 0 && ii < H && jj >= 0 && jj < W) a += (double)x[ii * W + jj] * w[p * K + q]; } r[i * W + j] = a; }
      dim3 g = {(unsigned)(W + 15) / 16, (unsigned)(H + 15) / 16};
      for (int k = 0; k < K * K; k++) conv_filter[k] = w[k];
      auto y = nanv(H * W); launch(g, {16, 16}, [&] { conv2d_v1(x.data(), w.data(), y.data(), H, W, K); }); cmp("conv2d_v1", y, r, 1e-4);
      y = nanv(H * W); launch(g, {16, 16}, [&] { conv2d_v2(x.data(), w.data(), y.data(), H, W, K); }); cmp("conv2d_v2", y, r, 1e-4);
      y = nanv(H * W); launch(g, {16, 16}, [&] { conv2d_v3(x.data(), y.data(), H, W, K); }); cmp("conv2d_v3", y, r, 1e-4); }
    { int B = 2, C = 3, CO = 2, H = 9, W = 17, K = 3; auto x = randn(B * C * H * W), w = randn(CO * C * K * K);
      std::vector<double> r(B * CO * H * W);
      for (int b = 0; b < B; b++) for (int co = 0; co < CO; co++) for (int i = 0; i < H; i++) for (int j = 0; j < W; j++) { double a = 0;
        for (int c = 0; c < C; c++) for (int p = 0; p < K; p++) for (int q = 0; q < K; q++) { int ii = i + p - 1, jj = j + q - 1;
          if (ii >= 0 && ii < H && jj >= 0 && jj < W) a += (double)x[((b * C + c) * H + ii) * W + jj] * w[((co * C + c) * K + p) * K + q]; }
        r[((b * CO + co) * H + i) * W + j] = a; }
      auto y = nanv(B * CO * H * W);
      launch({2, 1, (unsigned)(B * CO)}, {16, 16}, [&] { conv2d_v4(x.data(), w.data(), y.data(), B, C, CO, H, W, K); }); cmp("conv2d_v4", y, r, 1e-4); }
    printf("%d failures\n", fails);
    return fails != 0;
}
