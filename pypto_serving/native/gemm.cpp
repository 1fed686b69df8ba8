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

// ---- a quantized model's weights for the graphs' wide matmuls ----
//
// An int4 or GGUF model keeps its weights in records alone; a prefill chunk's matmuls take
// them dequantized (`pypto_records_gemm`): each weight is what gguf's dequantization computes
// in float32 (q * scale + minimum for Q4_1, q * scale for Q8_0, each operation rounded on its
// own: no fused multiply-add), rounded to bf16, the HF conversion's very weights. A thread
// dequantizes a group of panels of 16 output rows into its own buffer (L2), then runs every
// row of x over them: with AVX512-BF16 as bf16 pairs and pair dot products, else as float32
// and the panels' FMA tiles above. Each output is one chain over the inputs in order, from
// zero, whatever the rows.

typedef uint32_t vu __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));

// A weight row's value from its byte field: q * scale + minimum, each operation rounded (the
// function is built without contraction into a fused multiply-add), then its bf16 bits
// (rounding to nearest even) in the low half of each lane.
__attribute__((optimize("fp-contract=off"), always_inline)) inline vu bf16_bits(vi q, vf scale,
                                                                                 vf minimum) {
    const vf value = __builtin_convertvector(q, vf) * scale + minimum;
    vu u;
    std::memcpy(&u, &value, sizeof u);
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

// VW fp16 values as float32.
inline vf halves(const uint16_t* h) {
#if defined(__AVX512F__)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
#elif defined(__AVX__) && defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
#else
    vf v;
    for (int i = 0; i < VW; ++i) v[i] = fp16(h[i]);
    return v;
#endif
}

// Inputs i and i + 1 of VW rows (bf16 bits in a lane each) into the panel: pairs, one word
// per row ([K / 2][16][2]); else each widened to float32 ([K][16]).
inline void put_pair(void* out, int64_t i, int h, vu a, vu b, bool pairs) {
    if (pairs) {
        const vu word = a | (b << 16);
        std::memcpy(static_cast<uint32_t*>(out) + (i / 2) * 16 + h * VW, &word, sizeof word);
    } else {
        float* dst = static_cast<float*>(out) + i * 16 + h * VW;
        const vu wa = a << 16, wb = b << 16;
        std::memcpy(dst, &wa, sizeof wa);
        std::memcpy(dst + 16, &wb, sizeof wb);
    }
}

#if defined(__AVX512BF16__)
// Inputs i and i + 1 of the 16 rows, q_a and q_b (int32 lanes), as one pair word per row:
// q * scale + minimum, each operation rounded to nearest (embedded rounding: never fused),
// both rounded to bf16 together and interleaved row by row.
inline void pair_words(uint32_t* dst, __m512i qa, __m512i qb, __m512 d, __m512 mn) {
    constexpr int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512 a = _mm512_add_round_ps(_mm512_mul_round_ps(_mm512_cvtepi32_ps(qa), d, nearest), mn, nearest);
    const __m512 b = _mm512_add_round_ps(_mm512_mul_round_ps(_mm512_cvtepi32_ps(qb), d, nearest), mn, nearest);
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // words: a's 16, then b's 16
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                           16, 0);
    _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(order, both));
}

// dequantize_panel's pairs with AVX512-BF16's instructions (the same bits): a pair of inputs
// in ten instructions, where the plain vector code below takes about twice as many.
void dequantize_pairs(const Matrix& w, int64_t b, uint32_t* out) {
    const int64_t groups = w.cols / GROUP_K;
    const bool q4 = w.format == Q4;
    const uint8_t* rec = w.data + b * groups * RECORD[w.format];
    const __m512i nibble = _mm512_set1_epi32(0x0F), byte = _mm512_set1_epi32(0xFF);
    const __m512i offset = _mm512_set1_epi32(128);
    for (int64_t g = 0; g < groups; ++g, rec += RECORD[w.format]) {
        prefetch_ahead<2>(rec, w.format);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(rec + (q4 ? 256 : 512))));
        const __m512 mn = q4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(rec + 288)))
                             : _mm512_setzero_ps();
        uint32_t* dst = out + g * (GROUP_K / 2) * 16;
        for (int c = 0; c < (q4 ? 4 : 8); ++c) {
            const __m512i v = _mm512_loadu_si512(rec + 64 * c);
            for (int j = 0; j < 4; j += 2) {
                if (q4) {  // byte j: input 8c + j in its low nibble, 8c + 4 + j in its high one
                    pair_words(dst + (4 * c + j / 2) * 16,
                               _mm512_and_si512(_mm512_srli_epi32(v, 8 * j), nibble),
                               _mm512_and_si512(_mm512_srli_epi32(v, 8 * j + 8), nibble), d, mn);
                    pair_words(dst + (4 * c + 2 + j / 2) * 16,
                               _mm512_and_si512(_mm512_srli_epi32(v, 8 * j + 4), nibble),
                               _mm512_and_si512(_mm512_srli_epi32(v, 8 * j + 12), nibble), d, mn);
                } else {  // byte j: input 4c + j, plus 128
                    pair_words(dst + (2 * c + j / 2) * 16,
                               _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(v, 8 * j), byte), offset),
                               _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(v, 8 * j + 8), byte), offset),
                               d, mn);
                }
            }
        }
    }
}
#endif

// Panel b (output rows 16b .. 16b + 15) of records w, dequantized: pairs, [K / 2][16][2] bf16
// (one 32-bit word per row and pair of inputs); else [K][16] float32 (the bf16 values
// widened). The record's rows lie across the lanes, VW at a time.
// The records are asked for ahead as the native step's products ask (a panel's dequantization
// outruns the hardware prefetcher: one row's call over SmolLM2's weights went 7.4 -> 6.0 ms).
__attribute__((optimize("fp-contract=off"))) void dequantize_panel(const Matrix& w, int64_t b,
                                                                  void* out, bool pairs) {
#if defined(__AVX512BF16__)
    if (pairs) return dequantize_pairs(w, b, static_cast<uint32_t*>(out));
#endif
    const int64_t groups = w.cols / GROUP_K;
    const bool q4 = w.format == Q4;
    const uint8_t* rec = w.data + b * groups * RECORD[w.format];
    for (int64_t g = 0; g < groups; ++g, rec += RECORD[w.format]) {
        prefetch_ahead<2>(rec, w.format);
        const uint16_t* scales = reinterpret_cast<const uint16_t*>(rec + (q4 ? 256 : 512));
        const int64_t i0 = g * GROUP_K;
        for (int h = 0; h < 16 / VW; ++h) {  // rows VW h .. VW h + VW - 1
            const vf dv = halves(scales + h * VW);
            const vf mv = q4 ? halves(scales + 16 + h * VW) : vf{};
            for (int c = 0; c < (q4 ? 4 : 8); ++c) {
                vu v;
                std::memcpy(&v, rec + 64 * c + 4 * VW * h, sizeof v);
                if (q4) {  // byte j: input 8c + j in its low nibble, 8c + 4 + j in its high one
                    for (int j = 0; j < 4; j += 2) {
                        put_pair(out, i0 + 8 * c + j, h, bf16_bits(vi((v >> (8 * j)) & 0x0Fu), dv, mv),
                                 bf16_bits(vi((v >> (8 * j + 8)) & 0x0Fu), dv, mv), pairs);
                        put_pair(out, i0 + 8 * c + 4 + j, h,
                                 bf16_bits(vi((v >> (8 * j + 4)) & 0x0Fu), dv, mv),
                                 bf16_bits(vi((v >> (8 * j + 12)) & 0x0Fu), dv, mv), pairs);
                    }
                } else {  // byte j: input 4c + j, plus 128
                    for (int j = 0; j < 4; j += 2)
                        put_pair(out, i0 + 4 * c + j, h,
                                 bf16_bits(vi((v >> (8 * j)) & 0xFFu) - 128, dv, mv),
                                 bf16_bits(vi((v >> (8 * j + 8)) & 0xFFu) - 128, dv, mv), pairs);
                }
            }
        }
    }
}

#if defined(__AVX512BF16__)
// Rows of x a tile over NP panels: NP x rows accumulators of the 32 registers, NP panels'
// loads and a broadcast.
template <int NP>
constexpr int pair_tile_rows() { return NP >= 4 ? 6 : 12; }
#ifndef PAIR_PANELS
#define PAIR_PANELS 4  // panels a tile takes at once where a thread's group has them
#endif

// c[0..R) (32 outputs of two pair panels, or 16 of one) = x[0..R) . the panels, each output
// one chain of bf16 pair dot products over the inputs in order, from zero.
template <int R, int NP>
void pair_tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t panel_stride, int k,
               float* c, int64_t ldc) {
    __m512 acc[R][NP];
    for (int m = 0; m < R; ++m)
        for (int q = 0; q < NP; ++q) acc[m][q] = _mm512_setzero_ps();
    for (int j = 0; j < k / 2; ++j) {
        __m512bh b[NP];
        for (int q = 0; q < NP; ++q)
            b[q] = (__m512bh)_mm512_loadu_si512(w + q * panel_stride + int64_t(j) * 32);
        for (int m = 0; m < R; ++m) {
            int32_t pair;
            std::memcpy(&pair, x + m * ldx + 2 * j, sizeof pair);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            for (int q = 0; q < NP; ++q) acc[m][q] = _mm512_dpbf16_ps(acc[m][q], a, b[q]);
        }
    }
    for (int m = 0; m < R; ++m)
        for (int q = 0; q < NP; ++q) _mm512_storeu_ps(c + m * ldc + q * 16, acc[m][q]);
}

template <int NP>
void pair_rows(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t panel_stride, int k,
               float* c, int64_t ldc, int rows) {
    constexpr int RT = pair_tile_rows<NP>();
    int m = 0;
    for (; m + RT <= rows; m += RT)
        pair_tile<RT, NP>(x + m * ldx, ldx, w, panel_stride, k, c + m * ldc, ldc);
    x += m * ldx;
    c += m * ldc;
    switch (rows - m) {
#define REST(r) \
    case r:     \
        if constexpr (r < RT) pair_tile<r, NP>(x, ldx, w, panel_stride, k, c, ldc); \
        break;
        REST(1) REST(2) REST(3) REST(4) REST(5) REST(6) REST(7) REST(8) REST(9) REST(10)
        REST(11)
#undef REST
        default: break;
    }
}
#endif

}  // namespace

// Whether this build multiplies records by bf16 pairs (AVX512-BF16) in `pypto_records_gemm`.
extern "C" int pypto_records_pairs_built() {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

// out [rows][16 ceil(w.rows / 16)] = x [rows][w.cols] @ w.T over a weight in records (Q4, Q8),
// dequantized as above; x bf16 with pairs (AVX512-BF16 builds only), else float32; out
// float32, or bf16 (out_bf16: each sum rounded to nearest even, as torch rounds). The team
// shares groups of panels (a thread's buffer of at most 512 KB stays in L2, and each thread
// gets as many); a thread dequantizes its group once and runs every row over it, ROW_BLOCK
// rows at a time (their sums kept in float32 until then). Returns 0, or 1 for a shape (or a
// build) it does not take.
extern "C" int pypto_records_gemm(const Matrix* w, const void* x, int rows, void* out,
                                  int out_bf16, int pairs, int threads) {
    if (rows < 1 || w->cols % GROUP_K || (w->format != Q4 && w->format != Q8)) return 1;
#if !defined(__AVX512BF16__)
    if (pairs) return 1;
#endif
    constexpr int ROW_BLOCK = 256;
    const int64_t k = w->cols, count = (w->rows + 15) / 16, ldo = count * 16;
    const int64_t panel_bytes = k * 16 * (pairs ? 2 : 4);
    // groups of at most 512 KB, as many as make an equal share for every thread
    const int64_t most = std::max<int64_t>(1, (int64_t(1) << 19) / panel_bytes);
    const int64_t shares = (std::max<int64_t>(threads, (count + most - 1) / most) + threads - 1) /
                           threads * threads;
    const int64_t group = (count + shares - 1) / shares;
#pragma omp parallel num_threads(threads)
    {
        // a thread's buffers, kept from call to call: grown, never cleared (each call writes
        // what it reads), where a new one's zeroing cost a few rows' call a tenth of its time
        thread_local std::vector<uint8_t> buffer;
        thread_local std::vector<float> sums;
        buffer.resize(std::max(buffer.size(), size_t(group * panel_bytes) + 64));
        if (out_bf16) sums.resize(std::max(sums.size(), size_t(ROW_BLOCK) * group * 16));
        void* local = buffer.data() + (64 - reinterpret_cast<uintptr_t>(buffer.data()) % 64) % 64;
#pragma omp for schedule(static)
        for (int64_t p0 = 0; p0 < count; p0 += group) {
            const int64_t n = std::min(group, count - p0);
            for (int64_t p = 0; p < n; ++p)
                dequantize_panel(*w, p0 + p, static_cast<uint8_t*>(local) + p * panel_bytes, pairs);
            for (int r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
                const int rb = std::min(ROW_BLOCK, rows - r0);
                float* block = out_bf16 ? sums.data() : static_cast<float*>(out) + r0 * ldo + p0 * 16;
                const int64_t ldc = out_bf16 ? n * 16 : ldo;
                for (int64_t p = 0; p < n; ++p) {
                    float* c = block + p * 16;
                    if (pairs) {
#if defined(__AVX512BF16__)
                        const uint16_t* panel = static_cast<const uint16_t*>(local) + p * k * 16;
                        const uint16_t* xb = static_cast<const uint16_t*>(x) + r0 * k;
                        if (p + PAIR_PANELS <= n) {
                            pair_rows<PAIR_PANELS>(xb, k, panel, k * 16, int(k), c, ldc, rb);
                            p += PAIR_PANELS - 1;
                        } else if (p + 2 <= n) {
                            pair_rows<2>(xb, k, panel, k * 16, int(k), c, ldc, rb);
                            ++p;
                        } else {
                            pair_rows<1>(xb, k, panel, k * 16, int(k), c, ldc, rb);
                        }
#endif
                    } else {
                        const float* panel = static_cast<const float*>(local) + p * k * 16;
                        const float* xf = static_cast<const float*>(x) + r0 * k;
                        rows_over(xf, k, panel, int(k), c, ldc, true, rb);
                    }
                }
                if (out_bf16)
                    for (int m = 0; m < rb; ++m) {
                        uint16_t* dst = static_cast<uint16_t*>(out) + (r0 + m) * ldo + p0 * 16;
                        for (int64_t j = 0; j < n * 16; ++j) dst[j] = to_bf16(block[m * ldc + j]);
                    }
            }
        }
    }
    return 0;
}

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

namespace {

constexpr int MOE_CHUNK = 256;  // tokens of a step `pypto_moe_records` takes at a time

// `pypto_moe_records`' buffers: the chosen experts' rows (inputs, gate_up's outputs, SwiGLU's,
// down's) one after another, and each expert's quantized inputs to its two products.
struct MoeScratch {
    std::vector<float> xs, gu, h, y;
    std::vector<Activations> qx, qh;

    static float* grown(std::vector<float>& v, size_t n) {
        if (v.size() < n) v.resize(n);
        return v.data();
    }
};

}  // namespace

// Tokens [t0, t1) of `pypto_moe_records`' step, its arguments as there.
static void moe_chunk(const Matrix* gate_up, int64_t gate_up_bytes, const Matrix* down,
                      int64_t down_bytes, const int64_t* expert_ids, int held, const float* x,
                      int t0, int t1, const int64_t* ids, const float* weights, int k, float* out,
                      int threads) {
    const int64_t hidden = gate_up->cols, inter = down->cols;
    const int rows = t1 - t0;
    x += int64_t(t0) * hidden;
    ids += int64_t(t0) * k;
    weights += int64_t(t0) * k;
    out += int64_t(t0) * hidden;
    std::vector<std::vector<int64_t>> routed(held);  // per held expert: its (token * k + slot)s
    for (int64_t pair = 0; pair < int64_t(rows) * k; ++pair) {
        const int64_t* at = std::lower_bound(expert_ids, expert_ids + held, ids[pair]);
        if (at != expert_ids + held && *at == ids[pair]) routed[at - expert_ids].push_back(pair);
    }
    // The chosen experts' rows, one after another: row i is pair[i] through expert chosen[of[i]].
    std::vector<int> chosen, of;
    std::vector<int64_t> first, pair;
    std::vector<std::vector<int64_t>> token_rows(rows);  // each token's rows, by expert id
    for (int j = 0; j < held; ++j) {
        if (routed[j].empty()) continue;
        first.push_back(int64_t(pair.size()));
        for (const int64_t p : routed[j]) {
            token_rows[p / k].push_back(int64_t(pair.size()));
            pair.push_back(p);
            of.push_back(int(chosen.size()));
        }
        chosen.push_back(j);
    }
    const int experts = int(chosen.size());
    const int64_t total = int64_t(pair.size());
    first.push_back(total);
    // the calling thread's buffers, kept from call to call (grown, never cleared: each call
    // writes what it reads), where fresh ones' page faults cost a 256-token step half its time
    thread_local MoeScratch kept;
    MoeScratch& s = kept;  // (the team shares the caller's: bound here, outside the region)
    if (s.qx.size() < size_t(experts)) {
        s.qx.resize(experts);
        s.qh.resize(experts);
    }
    std::vector<Matrix> w1(experts, *gate_up), w2(experts, *down);
    for (int c = 0; c < experts; ++c) {
        const int n = int(first[c + 1] - first[c]);
        s.qx[c].resize(n, int(hidden), false);
        s.qh[c].resize(n, int(inter), false);
        w1[c].data += chosen[c] * gate_up_bytes;
        w2[c].data += chosen[c] * down_bytes;
    }
    float* xs = s.grown(s.xs, size_t(total) * hidden);
    float* gu = s.grown(s.gu, size_t(total) * 2 * inter);
    float* h = s.grown(s.h, size_t(total) * inter);
    float* y = s.grown(s.y, size_t(total) * hidden);
    std::vector<Activations>& qx = s.qx;
    std::vector<Activations>& qh = s.qh;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < total; ++i) {
            const int c = of[i];
            std::copy_n(x + pair[i] / k * hidden, hidden, xs + size_t(i) * hidden);
            quantize_row(xs + size_t(first[c]) * hidden, int(i - first[c]), w1[c].format, qx[c]);
        }
        for (int c = 0; c < experts; ++c) {  // each expert's blocks shared, no wait between
            const int n = int(first[c + 1] - first[c]);
            product(w1[c], qx[c], n, gu + size_t(first[c]) * 2 * inter, 2 * inter, false, false);
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t i = 0; i < total; ++i) {  // SwiGLU: silu(gate) * up
            const int c = of[i];
            const float* g = gu + size_t(i) * 2 * inter;
            float* a = h + size_t(i) * inter;
            for (int64_t j = 0; j < inter; ++j) a[j] = g[j] / (1.0f + std::exp(-g[j])) * g[inter + j];
            quantize_row(h + size_t(first[c]) * inter, int(i - first[c]), w2[c].format, qh[c]);
        }
        for (int c = 0; c < experts; ++c) {
            const int n = int(first[c + 1] - first[c]);
            product(w2[c], qh[c], n, y + size_t(first[c]) * hidden, hidden, false, false);
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (int t = 0; t < rows; ++t) {
            float* o = out + int64_t(t) * hidden;
            std::fill(o, o + hidden, 0.0f);
            for (const int64_t i : token_rows[t]) {
                const float weight = weights[pair[i]];
                const float* v = y + size_t(i) * hidden;
                for (int64_t j = 0; j < hidden; ++j) o[j] += weight * v[j];
            }
        }
    }
}

// The routed experts of a MoE block over records (a GGUF file's Q4_1 / Q8_0 experts): rows
// tokens x [rows][hidden] (float32), token t routed to ids[t][0..k) with weights[t][0..k)
// (float32); the block holds `held` experts, whose global ids are expert_ids (rising), expert
// j's gate_up (2I x hidden: gate's rows, then up's) at gate_up->data + j * gate_up_bytes and
// its down (hidden x I) at down->data + j * down_bytes. MOE_CHUNK tokens at a time (a
// prefill's thousands would otherwise keep buffers of gigabytes), every chosen expert's
// tokens' rows are quantized per 32 inputs (records.h's, as the decode step's), then the team
// runs all their gate_up products at once (no wait between one expert's and the next),
// silu(gate) * up in float32 (quantized), all the down products, and out[t] = the sum of
// weight * that over token t's experts in the order of the held ids (out [rows][hidden]
// float32). Each row's result is the same bits whatever rows share the call. Returns 0, or 1
// for shapes it does not take.
extern "C" int pypto_moe_records(const Matrix* gate_up, int64_t gate_up_bytes, const Matrix* down,
                                 int64_t down_bytes, const int64_t* expert_ids, int held,
                                 const float* x, int rows, const int64_t* ids,
                                 const float* weights, int k, float* out, int threads) {
    const int64_t hidden = gate_up->cols, inter = down->cols;
    if (rows < 0 || hidden % GROUP_K || inter % GROUP_K || gate_up->rows != 2 * inter ||
        down->rows != hidden || gate_up->format < Q4 || gate_up->format > Q8 ||
        down->format < Q4 || down->format > Q8)
        return 1;
    for (int t0 = 0; t0 < rows; t0 += MOE_CHUNK)
        moe_chunk(gate_up, gate_up_bytes, down, down_bytes, expert_ids, held, x, t0,
                  std::min(rows, t0 + MOE_CHUNK), ids, weights, k, out, threads);
    return 0;
}
