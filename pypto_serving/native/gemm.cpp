// Matmuls of many rows (prefill chunks, batched decodes) over bf16 weights on CPUs whose
// oneDNN cannot pack bf16 (no AVX-512 BF16: AVX2 CPUs): out = x @ w.T (+ bias), computed in
// float32 with FMAs, the weights staying bf16 in memory (half the bytes of float32). Under
// --batch-invariant every matmul of a bf16 or float32 model runs here (float32 panels too).
//
// The weight [N, K] is kept in panels ([ceil(N / 16)][K][16] bf16, rows past N zero; packed
// once at load by ops/linear.py): panel p holds output columns 16p .. 16p + 15, input by
// input. The team shares the panels; a thread widens a block of KC inputs of its panel to
// float32 once (a 16-bit shift) and runs every row of x over it, MR rows at a time, each
// with its 16 columns in registers (the outer-product kernel BLIS uses on Haswell: MR x 16
// accumulators, one broadcast of x and two or one vector loads of the panel per input).
//
// Each output is one chain of FMAs over k = 0, 1, ..., K - 1 from zero, then + bias: the same
// whatever the number of rows, their order or the tiling, so a row's result does not depend
// on the batch it came in.
//
// Also here, shape-free like the panels: records.h's product over weights in 4-bit or 8-bit
// records for any number of rows (`pypto_packed_product`), which under --batch-invariant is
// every matmul of a quantized model.
#include "records.h"

namespace {

#if defined(__AVX512F__)
constexpr int VW = 16;  // floats in a vector register
constexpr int MR = 12;  // rows of x a tile: MR x NV accumulators of the 32 registers
#elif defined(__AVX__)
constexpr int VW = 8;
constexpr int MR = 6;   // 12 accumulators + 2 panel vectors + a broadcast of the 16
#else
constexpr int VW = 4;
constexpr int MR = 3;
#endif
constexpr int NR = 16;       // columns a panel
constexpr int NV = NR / VW;  // vectors a panel row
constexpr int KC = 256;      // inputs a block: a widened block is 16 KB (L1)
constexpr int MC = 96;       // rows a pass over a block: their inputs 96 KB (L2)

typedef float vf __attribute__((vector_size(VW * 4)));

inline vf load(const float* p) {
    vf v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

inline float widen(uint16_t h) {  // bfloat16 -> float32: its bits are the high half
    const uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

inline float widen(float f) { return f; }

// c[0..R) (16 outputs each, rows ldc apart; the first block starts from zero) += x[0..R) . block.
template <int R>
void tile(const float* x, int64_t ldx, const float* block, int kc, float* c, int64_t ldc,
          bool first) {
    vf acc[R][NV];
    for (int m = 0; m < R; ++m)
        for (int v = 0; v < NV; ++v) acc[m][v] = first ? vf{} : load(c + m * ldc + v * VW);
    for (int k = 0; k < kc; ++k) {
        vf b[NV];
        for (int v = 0; v < NV; ++v) b[v] = load(block + k * NR + v * VW);
        for (int m = 0; m < R; ++m) {
            const float a = x[m * ldx + k];
            for (int v = 0; v < NV; ++v) acc[m][v] += a * b[v];
        }
    }
    for (int m = 0; m < R; ++m)
        for (int v = 0; v < NV; ++v) store(c + m * ldc + v * VW, acc[m][v]);
}

// rows of x over a block: MR at a time, then a tile of the rest (the same chain per output).
void rows_over(const float* x, int64_t ldx, const float* block, int kc, float* c, int64_t ldc,
               bool first, int rows) {
    int m = 0;
    for (; m + MR <= rows; m += MR) tile<MR>(x + m * ldx, ldx, block, kc, c + m * ldc, ldc, first);
    x += m * ldx;
    c += m * ldc;
    switch (rows - m) {
#define REST(r) case r: tile<r>(x, ldx, block, kc, c, ldc, first); break;
        REST(1) REST(2) REST(3) REST(4) REST(5) REST(6) REST(7) REST(8) REST(9) REST(10)
        REST(11)
#undef REST
        default: break;
    }
}

// out [M][ldo] = x [M][ldx] @ w.T (+ bias [N] in W, or null), with w in panels of W as
// above; float32 x and out, whose rows hold every panel's 16 columns (ldo >= 16 ceil(N / 16);
// the columns from N on are the zero rows'). Returns 0, or 1 for shapes it does not take.
// Loops: blocks of KC inputs, then MC rows (both stay in L2), then the panels, shared by the
// team; the outputs carry each chain from block to block.
template <typename W>
int gemm(const float* x, int64_t ldx, const W* panels, const W* bias, float* out, int64_t ldo,
         int M, int N, int K, int threads) {
    const int count = (N + NR - 1) / NR;
    if (M < 1 || N < 1 || K < 1 || ldo < int64_t(count) * NR) return 1;
#pragma omp parallel num_threads(threads)
    {
        alignas(64) float block[KC * NR];  // a block of a panel, widened
        for (int k0 = 0; k0 < K; k0 += KC) {
            const int kc = K - k0 < KC ? K - k0 : KC;
            for (int m0 = 0; m0 < M; m0 += MC) {
                const int rows = M - m0 < MC ? M - m0 : MC;
#pragma omp for schedule(static)
                for (int p = 0; p < count; ++p) {
                    const W* src = panels + (int64_t(p) * K + k0) * NR;
                    for (int i = 0; i < kc * NR; ++i) block[i] = widen(src[i]);
                    rows_over(x + m0 * ldx + k0, ldx, block, kc, out + m0 * ldo + p * NR, ldo,
                              k0 == 0, rows);
                }
            }
        }
        if (bias != nullptr) {
#pragma omp for schedule(static)
            for (int m = 0; m < M; ++m)
                for (int n = 0; n < N; ++n) out[m * ldo + n] += widen(bias[n]);
        }
    }
    return 0;
}

}  // namespace

// Panels of bf16 (the weights of bf16 models) and of float32 (float32 models under
// --batch-invariant); the arguments as `gemm`'s.
extern "C" int pypto_panel_gemm(const float* x, int64_t ldx, const uint16_t* panels,
                                const uint16_t* bias, float* out, int64_t ldo, int M, int N,
                                int K, int threads) {
    return gemm(x, ldx, panels, bias, out, ldo, M, N, K, threads);
}

extern "C" int pypto_panel_gemm_f32(const float* x, int64_t ldx, const float* panels,
                                    const float* bias, float* out, int64_t ldo, int M, int N,
                                    int K, int threads) {
    return gemm(x, ldx, panels, bias, out, ldo, M, N, K, threads);
}

// out [rows][w.rows] = x [rows][w.cols] @ w.T (+ bias) over a weight in records (Q4, Q8) or
// bf16 rows, x quantized per row as the native decode step quantizes it, any number of rows:
// the team quantizes the rows, then shares the weight's blocks (records.h's `product`). Over
// records a row's result is the same bits whatever rows share the call (the decode step's
// matmuls compute exactly this for its rows). Returns 0, or 1 for a shape it does not take.
extern "C" int pypto_packed_product(const Matrix* w, const float* x, int rows, float* out,
                                    int threads) {
    if (rows < 1 || w->cols % GROUP_K || w->format < Q4 || w->format > BF16) return 1;
    Activations qx;
    qx.resize(rows, int(w->cols));
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int m = 0; m < rows; ++m) quantize_row(x, m, w->format, qx);
        product(*w, qx, rows, out, w->rows, false);
    }
    return 0;
}
