// The matmul of the native kernels over weights packed in records (the native decode step's
// matmuls, and under --batch-invariant every matmul of a quantized model), shared by
// decode.cpp and gemm.cpp. The product of up to BLOCK_ROWS rows at a time over a block of 16
// output rows: a row's arithmetic is the same whichever other rows share the block, so its
// result does not depend on the batch it came in.
//
// Decoding a few sequences is memory-bound: each weight is read once per step and used for a
// few rows. The matmuls read weights packed by ops/linear.py (`pack_q4`, `pack_q8`) in records
// of 16 output rows by 32 inputs, the rows across the vector lanes:
//   Q4: 4 x 64 bytes of 4-bit values (lane r: byte j holds inputs 8c + j in its low nibble
//       and 8c + 4 + j in its high one, for c = 0..3), then 16 fp16 scales and 16 fp16
//       minimums: the weight is q * scale + minimum (llama.cpp's Q4_1), 320 bytes;
//   Q8: 8 x 64 bytes of int8 values + 128 (lane r: inputs 4c .. 4c + 3), then 16 fp16
//       scales: the weight is (u - 128) * scale (Q8_0), 544 bytes.
// A row's records follow each other along its inputs, and a block of 16 rows' records lie
// together, so each thread streams its blocks once. The activations are quantized to int8
// per group of 32 (a scale each: llama.cpp's Q8_1), and the products summed in int32 with
// AVX512-VNNI dot products (u8 x s8). On AVX2 the same records are read 8 rows (half a
// record) at a time with the instructions llama.cpp uses there: vpmaddubsw (u8 x s8 pairs into
// int16) and vpmaddwd (pairs of int16 into int32), or AVX-VNNI's vpdpbusd where the CPU has it.
// The integer sums are exact on every path (Q4: 8 products of at most 15 x 127 per int16;
// Q8: |weight| x sign-adjusted activation, at most 2 x 127 x 127), and the float steps are
// the same, so AVX2 and AVX-512 give the same results. Elsewhere plain loops read the layout.
// AVX-VNNI's path is tested on CPUs without it too: built with PYPTO_EMULATE_AVX_VNNI, its
// vpdpbusd is the same integer sums in AVX2 instructions (`dot4`), and the rest its own code.
//
// Unquantized bf16 models' weights (the decode step's) are read where they lie, row by row
// ([rows, cols]), with the activations rounded to bf16: AVX512-BF16 dot products, or on AVX2
// each bf16 widened to float32 (a 16-bit shift) and FMAs, four chains a row whatever the
// rows (a row's result does not depend on its company).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__F16C__)
#define PYPTO_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PYPTO_AVX2 1  // 8 rows a register: two halves of a record's 16
#if defined(__AVXVNNI__) || defined(PYPTO_EMULATE_AVX_VNNI)
#define PYPTO_AVX_VNNI 1  // AVX-VNNI's path (tests build it emulated for CPUs without it)
#endif
#endif

namespace {

constexpr int BLOCK_ROWS = 8;  // rows of x a block product takes at once
// From this many rows in a block, a product over records runs the whole block (the rows past
// the last padded with zeros, their sums dropped). AVX-512 VNNI: SmolLM2's native step of 5,
// 6 and 7 rows took 7.0, 8.1 and 9.5 ms, more than 8 rows' 7.3, and 6.4, 6.6 and 7.3 padded
// (bench/native_rows.py). On AVX2 a block's eighth row costs as much as its first few, so
// none is padded there.
#if defined(PYPTO_VNNI)
constexpr int PADDED_ROWS = 5;
#else
constexpr int PADDED_ROWS = BLOCK_ROWS;
#endif
// The most rows a product over records takes in one pass over a block of the weight: the
// rows past BLOCK_ROWS are the first of the next block of rows (a last block of 1 or 2 rows
// joins the one before it). AVX-512 VNNI: SmolLM2's native step of 9 rows took 8.5 ms
// against 8 rows' 6.8, the ninth row's own pass unpacking every Q4 record again for one
// row's dot products (bench/native_rows.py); its products now take 5.2 ms against 6.0. 10
// rows keep their 20 accumulators in the 32 registers; AVX2's 16 hold no more than 8 rows'.
#if defined(PYPTO_VNNI)
constexpr int WIDE_ROWS = 10;
#else
constexpr int WIDE_ROWS = BLOCK_ROWS;
#endif
constexpr int GROUP_K = 32;    // inputs per quantization group
constexpr int Q4 = 1, Q8 = 2, BF16 = 3;
constexpr int RECORD[] = {0, 320, 544, 0};  // bytes of a 16-row x 32-input record, by format
constexpr int PREFETCH_BYTES = 2048;  // how far ahead of its record a product of rows asks for

// Asks for the record PREFETCH_BYTES after `rec` into the cache. A product of a few rows
// spends long enough on each record that the hardware prefetcher falls behind: the 1B shape's
// native step (AVX-512, bench/native_rows.py) took 40.1 ms for 8 rows with it, 58.1 without,
// 4 rows 35.8 / 43.0, 32 rows 140.6 / 163.0. One row's product keeps up without it, and
// asking cost that step ~4 % (26.4 / 25.6 ms), so it is asked for from 2 rows on. A prefetch
// past the weight's end is harmless.
template <int M>
inline void prefetch_ahead(const uint8_t* rec, int format) {
#if defined(__x86_64__)
    if (M > 1)
        for (int line = 0; line < RECORD[format]; line += 64)
            _mm_prefetch(reinterpret_cast<const char*>(rec + PREFETCH_BYTES + line), _MM_HINT_T0);
#endif
}


struct Matrix {   // a packed weight [rows, cols] (rows padded to 16 in the records), or bf16
    const uint8_t* data;
    const uint16_t* bias;  // bfloat16 [rows], or null
    int64_t rows, cols;
    int32_t format;        // Q4, Q8, or BF16: the plain row-major weight
};

inline float bf16(uint16_t h) {
    const uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

inline float fp16(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    float f;
    if (exp == 0) {
        f = std::ldexp(float(man), -24);
    } else if (exp == 31) {
        f = man ? NAN : INFINITY;
    } else {
        const uint32_t u = ((exp + 112) << 23) | (man << 13);
        std::memcpy(&f, &u, sizeof f);
    }
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    u |= sign;
    std::memcpy(&f, &u, sizeof f);
    return f;
#endif
}

// Activations as the next matmul reads them: for Q4 and Q8 weights quantized per group of 32,
// q and per group its scale, the sum of its values and their product (Q4_1's minimum term),
// laid out as a product of BLOCK_ROWS rows reads them: block by block of rows, group by
// group, the block's rows together (`at`; fewer rows than a block lie as closely), so one
// pointer walks a block's groups (a product of 8 rows kept 8 of each in registers, and the
// compiler spilled its loop counters); for
// bf16 weights rounded to bf16, bf [rows][k] (and on AVX2 the same bf16 values as float32,
// f [rows][k]).
struct Activations {
    std::vector<int8_t> q;
    std::vector<float> scale, scaled_sum;
    std::vector<int32_t> sum;
    std::vector<uint16_t> bf;
    std::vector<float> f;
    int k = 0, groups = 0, stride = BLOCK_ROWS;

    // floats: room for the rows rounded to bf16 too (`bf`, `f`: a BF16 weight's inputs).
    void resize(int rows, int cols, bool floats = true) {
        k = cols;
        groups = cols / GROUP_K;
        stride = rows < PADDED_ROWS ? rows : BLOCK_ROWS;
        const size_t padded = size_t(rows + BLOCK_ROWS - 1) / BLOCK_ROWS * BLOCK_ROWS;
        q.resize(padded * cols);
        scale.resize(padded * groups);
        scaled_sum.resize(padded * groups);
        sum.resize(padded * groups);
        if (stride == BLOCK_ROWS && rows % BLOCK_ROWS >= PADDED_ROWS) {  // run whole: zeros
            for (int m = rows; m < int(padded); ++m)
                for (int g = 0; g < groups; ++g) {
                    const int64_t i = at(m, g);
                    std::memset(&q[i * GROUP_K], 0, GROUP_K);
                    scale[i] = scaled_sum[i] = 0.0f;
                    sum[i] = 0;
                }
        }
        if (floats) {
            bf.resize(size_t(rows) * cols);
            f.resize(size_t(rows) * cols);
        }
    }

    // Where row m's group g lies in scale, sum and scaled_sum (times GROUP_K: in q).
    int64_t at(int m, int g) const {
        return (int64_t(m / BLOCK_ROWS) * groups + g) * stride + m % BLOCK_ROWS;
    }

    // Where row m0 + m's group g lies from row m0's (m0 a multiple of BLOCK_ROWS; m past
    // BLOCK_ROWS in the next block of rows), in scale, sum and scaled_sum.
    int64_t from_first(int m, int g) const { return at(m, g) - at(0, 0); }
};

inline uint16_t to_bf16(float f) {  // rounding to nearest even
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Row `row` of a Q8 matrix's weights into out [cols]: each (u - 128) * scale in float32 (one
// product, as a GGUF's Q8_0 dequantizes) rounded to bf16, the HF conversion's very values (a
// tied model's embedding, looked up in its LM head's records).
inline void q8_row(const Matrix& m, int64_t row, float* out) {
    const int64_t groups = m.cols / 32, lane = row % 16;
    const uint8_t* rec = m.data + (row / 16) * groups * 544;
    for (int64_t g = 0; g < groups; ++g, rec += 544) {
        uint16_t h;
        std::memcpy(&h, rec + 512 + 2 * lane, sizeof h);
        const float scale = fp16(h);
        for (int c = 0; c < 8; ++c)
            for (int j = 0; j < 4; ++j) {
                const float q = float(int(rec[c * 64 + lane * 4 + j]) - 128);
                out[g * 32 + c * 4 + j] = bf16(to_bf16(q * scale));
            }
    }
}

// One group of 32 values as int8 (llama.cpp's Q8_1): q = round(v * 127 / max |v|), ties to
// even, its scale max |v| / 127 and the sum of the q. Each step is exact or the one rounding
// of the same float product, so the vector paths give the plain loop's very values.
inline void quantize_group(const float* v, int8_t* q, float& scale, int32_t& sum) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    constexpr int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512 s = _mm512_set1_ps(inv);
    const __m512i i0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v0, s), nearest));
    const __m512i i1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v1, s), nearest));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(i0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(i1));
    scale = amax / 127.0f;
    sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
#elif defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 x[4], top = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
        x[j] = _mm256_loadu_ps(v + 8 * j);
        top = _mm256_max_ps(top, _mm256_andnot_ps(sign, x[j]));
    }
    __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    t = _mm_max_ps(t, _mm_movehl_ps(t, t));
    const float amax = _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    __m256i n[4], total = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(x[j], _mm256_set1_ps(inv)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        n[j] = _mm256_cvtps_epi32(r);
        total = _mm256_add_epi32(total, n[j]);
    }
    // to int8 (every value fits): the packs interleave 128-bit lanes, the permute undoes it
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                        _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    scale = amax / 127.0f;
    sum = _mm_cvtsi128_si32(s4);
#else
    float amax = 0.0f;
    for (int i = 0; i < GROUP_K; ++i) amax = std::fmax(amax, std::fabs(v[i]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t s = 0;
    for (int i = 0; i < GROUP_K; ++i) {
        q[i] = int8_t(std::nearbyint(v[i] * inv));
        s += q[i];
    }
    scale = amax / 127.0f;
    sum = s;
#endif
}

// Row m of x [rows][cols] into `out` (sized for it) as a matmul over weights of `format`
// reads it: a row's values depend on that row alone.
void quantize_row(const float* x, int m, int format, Activations& out) {
    const int cols = out.k;
    const float* row = x + int64_t(m) * cols;
    if (format == BF16) {
        for (int i = 0; i < cols; ++i) {
            out.bf[int64_t(m) * cols + i] = to_bf16(row[i]);
            out.f[int64_t(m) * cols + i] = bf16(out.bf[int64_t(m) * cols + i]);
        }
        return;
    }
    for (int g = 0; g < out.groups; ++g) {
        const int64_t at = out.at(m, g);
        quantize_group(row + g * GROUP_K, &out.q[at * GROUP_K], out.scale[at], out.sum[at]);
        out.scaled_sum[at] = out.scale[at] * float(out.sum[at]);
    }
}

// acc[m][r] = x[m] . weight[n0 + r] for the n rows from n0 of a bf16 weight, row by row
// (bf16 dot products over 32 inputs at a time where the CPU has them).
template <int M>
void bf16_rows(const Matrix& w, int64_t n0, int64_t n, const Activations& x, int m0,
               float acc[M][16]) {
    const int64_t k = w.cols;
    const uint16_t* xbf = x.bf.data() + m0 * k;
    const float* xf = x.f.data() + m0 * k;
    for (int64_t r = 0; r < n; ++r) {
        const uint16_t* row = reinterpret_cast<const uint16_t*>(w.data) + (n0 + r) * k;
#if defined(__AVX512BF16__)
        __m512 a[M];
        for (int m = 0; m < M; ++m) a[m] = _mm512_setzero_ps();
        for (int64_t i = 0; i < k; i += 32) {
            const __m512bh v = (__m512bh)_mm512_loadu_si512(row + i);
            for (int m = 0; m < M; ++m)
                a[m] = _mm512_dpbf16_ps(a[m], v, (__m512bh)_mm512_loadu_si512(&xbf[m * k + i]));
        }
        for (int m = 0; m < M; ++m) acc[m][r] = _mm512_reduce_add_ps(a[m]);
#elif defined(PYPTO_AVX2)
        // Four chains of FMAs per row of x (one row keeps both FMA units busy), rows two at
        // a time: a row's sums are the same whichever rows share the call (speculative
        // decoding's verify rows must give what one row alone does).
        constexpr int NA = 4;
        for (int m0 = 0; m0 < M; m0 += 2) {
            const bool pair = m0 + 1 < M;
            __m256 a[2][NA];
            for (int m = 0; m < 2; ++m)
                for (int j = 0; j < NA; ++j) a[m][j] = _mm256_setzero_ps();
            for (int64_t i = 0; i < k; i += 8 * NA)  // k is a multiple of 32
                for (int j = 0; j < NA; ++j) {
                    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i + 8 * j));
                    const __m256 v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
                    a[0][j] = _mm256_fmadd_ps(v, _mm256_loadu_ps(&xf[m0 * k + i + 8 * j]), a[0][j]);
                    if (pair)
                        a[1][j] = _mm256_fmadd_ps(v, _mm256_loadu_ps(&xf[(m0 + 1) * k + i + 8 * j]), a[1][j]);
                }
            for (int m = 0; m < (pair ? 2 : 1); ++m) {
                const __m256 t = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a[m][0], a[m][1]), a[m][2]), a[m][3]);
                const __m128 h = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
                const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
                acc[m0 + m][r] = _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
            }
        }
#else
        for (int m = 0; m < M; ++m) {
            float s = 0.0f;
            for (int64_t i = 0; i < k; ++i) s += bf16(row[i]) * bf16(xbf[m * k + i]);
            acc[m][r] = s;
        }
#endif
    }
}

// Four int8 activations as one int32, to broadcast to every row's lane.
inline int32_t four(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

#if defined(PYPTO_AVX_VNNI)
// acc + the sums of four u8 x s8 products per int32 lane: AVX-VNNI's vpdpbusd. Built with
// PYPTO_EMULATE_AVX_VNNI for a CPU without it, the same sums exactly in AVX2 (each byte
// widened to int16, pairs of products summed by vpmaddwd), so tests run this path anywhere.
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    const __m256i even = _mm256_and_si256(u, _mm256_set1_epi16(0x00FF));
    const __m256i odd = _mm256_srli_epi16(u, 8);
    const __m256i s_even = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8);
    const __m256i s_odd = _mm256_srai_epi16(s, 8);
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(even, s_even),
                                                  _mm256_madd_epi16(odd, s_odd)));
#endif
}
#endif

// acc[m][r] = x[m] . weight[16 b + r] over block b of a Q4 or Q8 weight's records.
template <int M>
void packed_rows(const Matrix& w, int64_t b, const Activations& x, int m0, float acc[M][16]) {
    const uint8_t* rec = w.data + b * (w.cols / GROUP_K) * RECORD[w.format];
    const int groups = x.groups;
    // Rows m0 .. m0 + M - 1 of one block of BLOCK_ROWS (m0 is a multiple of it): group by
    // group, the block's rows lie together (Activations::at).
    const int64_t first = x.at(m0, 0);
    const int8_t* xq = x.q.data() + first * GROUP_K;
    const float* xscale = x.scale.data() + first;
    const float* xscaled = x.scaled_sum.data() + first;
    const int32_t* xsum = x.sum.data() + first;
    const int G = x.stride;  // a group's step in xscale, xsum (and GROUP_K times in xq)
    // row m's group 0 from row m0's (rows past BLOCK_ROWS: the next block's, `WIDE_ROWS`)
    int64_t row[M];
    for (int m = 0; m < M; ++m) row[m] = x.from_first(m, 0);
#if defined(PYPTO_VNNI)
    __m512 facc[M];
    for (int m = 0; m < M; ++m) facc[m] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int g = 0; g < groups; ++g, rec += RECORD[w.format], xq += G * GROUP_K) {
        prefetch_ahead<M>(rec, w.format);
        // A row's integer sums in one chain of dot products, or in two where a few rows
        // would leave the chain's latency exposed (exact sums: the same either way).
        constexpr int CHAINS = M < 4 ? 2 : 1;
        __m512i a[CHAINS][M];
        for (int m = 0; m < M; ++m) a[0][m] = a[CHAINS - 1][m] = _mm512_setzero_si512();
        if (w.format == Q4) {
            for (int c = 0; c < 4; ++c) {
                const __m512i v = _mm512_loadu_si512(rec + 64 * c);
                const __m512i lo = _mm512_and_si512(v, low);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                for (int m = 0; m < M; ++m) {
                    const int8_t* xm = xq + row[m] * GROUP_K + 8 * c;
                    a[0][m] = _mm512_dpbusd_epi32(a[0][m], lo, _mm512_set1_epi32(four(xm)));
                    a[CHAINS - 1][m] =
                        _mm512_dpbusd_epi32(a[CHAINS - 1][m], hi, _mm512_set1_epi32(four(xm + 4)));
                }
            }
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(rec + 256)));
            const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(rec + 288)));
            for (int m = 0; m < M; ++m) {
                const __m512i sum = CHAINS == 2 ? _mm512_add_epi32(a[0][m], a[1][m]) : a[0][m];
                const __m512 s = _mm512_cvtepi32_ps(sum);
                const __m512 sx = _mm512_set1_ps(xscale[g * G + row[m]]);
                facc[m] = _mm512_fmadd_ps(s, _mm512_mul_ps(d, sx), facc[m]);
                facc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xscaled[g * G + row[m]]), facc[m]);
            }
        } else {
            for (int c = 0; c < 8; ++c) {
                const __m512i v = _mm512_loadu_si512(rec + 64 * c);
                const int chain = c % CHAINS;
                for (int m = 0; m < M; ++m)
                    a[chain][m] = _mm512_dpbusd_epi32(
                        a[chain][m], v, _mm512_set1_epi32(four(xq + row[m] * GROUP_K + 4 * c)));
            }
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(rec + 512)));
            for (int m = 0; m < M; ++m) {
                const __m512i sum = CHAINS == 2 ? _mm512_add_epi32(a[0][m], a[1][m]) : a[0][m];
                const __m512i bias = _mm512_set1_epi32(128 * xsum[g * G + row[m]]);
                const __m512i s = _mm512_sub_epi32(sum, bias);
                const __m512 sx = _mm512_set1_ps(xscale[g * G + row[m]]);
                facc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, sx), facc[m]);
            }
        }
    }
    for (int m = 0; m < M; ++m) _mm512_storeu_ps(acc[m], facc[m]);
#elif defined(PYPTO_AVX2)
    __m256 facc[M][2];
    for (int m = 0; m < M; ++m) facc[m][0] = facc[m][1] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F);
#if !defined(PYPTO_AVX_VNNI)
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(char(0x80));
#endif
    for (int g = 0; g < groups; ++g, rec += RECORD[w.format]) {
        prefetch_ahead<M>(rec, w.format);
        const int8_t* xg = xq + g * G * GROUP_K;
        for (int half = 0; half < 2; ++half) {  // rows 8 half .. 8 half + 7
            __m256i a[M];
            for (int m = 0; m < M; ++m) a[m] = _mm256_setzero_si256();
            if (w.format == Q4) {
                for (int c = 0; c < 4; ++c) {
                    const __m256i v = _mm256_loadu_si256((const __m256i*)(rec + 64 * c + 32 * half));
                    const __m256i lo = _mm256_and_si256(v, low);
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    for (int m = 0; m < M; ++m) {
                        const int32_t x0 = four(xg + row[m] * GROUP_K + 8 * c);
                        const int32_t x1 = four(xg + row[m] * GROUP_K + 8 * c + 4);
#if defined(PYPTO_AVX_VNNI)
                        a[m] = dot4(a[m], lo, _mm256_set1_epi32(x0));
                        a[m] = dot4(a[m], hi, _mm256_set1_epi32(x1));
#else  // int16 sums: 4 chunks x 2 x 2 products of at most 15 x 127 stay below 2^15
                        const __m256i p = _mm256_add_epi16(
                            _mm256_maddubs_epi16(lo, _mm256_set1_epi32(x0)),
                            _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x1)));
                        a[m] = _mm256_add_epi16(a[m], p);
#endif
                    }
                }
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(rec + 256 + 16 * half)));
                const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(rec + 288 + 16 * half)));
                for (int m = 0; m < M; ++m) {
#if defined(PYPTO_AVX_VNNI)
                    const __m256 s = _mm256_cvtepi32_ps(a[m]);
#else
                    const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(a[m], ones));
#endif
                    const __m256 sx = _mm256_set1_ps(xscale[g * G + row[m]]);
                    facc[m][half] = _mm256_fmadd_ps(s, _mm256_mul_ps(d, sx), facc[m][half]);
                    facc[m][half] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xscaled[g * G + row[m]]), facc[m][half]);
                }
            } else {
                for (int c = 0; c < 8; ++c) {
                    const __m256i u = _mm256_loadu_si256((const __m256i*)(rec + 64 * c + 32 * half));
#if !defined(PYPTO_AVX_VNNI)
                    const __m256i sw = _mm256_xor_si256(u, flip);  // the signed value u - 128
                    const __m256i aw = _mm256_abs_epi8(sw);
#endif
                    for (int m = 0; m < M; ++m) {
                        const int32_t x0 = four(xg + row[m] * GROUP_K + 4 * c);
#if defined(PYPTO_AVX_VNNI)
                        a[m] = dot4(a[m], u, _mm256_set1_epi32(x0));
#else  // |w| x (x with w's sign): pairs of at most 127 x 127 fit int16
                        const __m256i sx = _mm256_sign_epi8(_mm256_set1_epi32(x0), sw);
                        a[m] = _mm256_add_epi32(a[m], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones));
#endif
                    }
                }
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(rec + 512 + 16 * half)));
                for (int m = 0; m < M; ++m) {
#if defined(PYPTO_AVX_VNNI)
                    const __m256i s = _mm256_sub_epi32(a[m], _mm256_set1_epi32(128 * xsum[g * G + row[m]]));
#else
                    const __m256i s = a[m];
#endif
                    const __m256 sx = _mm256_set1_ps(xscale[g * G + row[m]]);
                    facc[m][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, sx), facc[m][half]);
                }
            }
        }
    }
    for (int m = 0; m < M; ++m) {
        _mm256_storeu_ps(acc[m], facc[m][0]);
        _mm256_storeu_ps(acc[m] + 8, facc[m][1]);
    }
#else
    for (int m = 0; m < M; ++m) std::fill(acc[m], acc[m] + 16, 0.0f);
    for (int g = 0; g < groups; ++g, rec += RECORD[w.format]) {
        const uint16_t* scales = reinterpret_cast<const uint16_t*>(rec + (w.format == Q4 ? 256 : 512));
        for (int m = 0; m < M; ++m) {
            const int8_t* xg = xq + (g * G + row[m]) * GROUP_K;
            const float sx = xscale[g * G + row[m]];
            for (int r = 0; r < 16; ++r) {
                int32_t s = 0;
                if (w.format == Q4) {
                    for (int c = 0; c < 4; ++c)
                        for (int j = 0; j < 4; ++j) {
                            const uint8_t byte = rec[64 * c + 4 * r + j];
                            s += (byte & 0x0F) * xg[8 * c + j] + (byte >> 4) * xg[8 * c + 4 + j];
                        }
                    acc[m][r] += float(s) * fp16(scales[r]) * sx +
                                 fp16(scales[16 + r]) * xscaled[g * G + row[m]];
                } else {
                    for (int c = 0; c < 8; ++c)
                        for (int j = 0; j < 4; ++j)
                            s += (int(rec[64 * c + 4 * r + j]) - 128) * xg[4 * c + j];
                    acc[m][r] += float(s) * fp16(scales[r]) * sx;
                }
            }
        }
    }
#endif
}

// out[m][n] (=|+=) x[m0 + m] . weight[n] (+ bias[n]) for the 16 rows of block b.
// stored: the rows kept (fewer than M where a last block of records runs whole: PADDED_ROWS).
template <int M>
void block_product(const Matrix& w, int64_t b, const Activations& x, int m0, float* out,
                   int64_t ldo, bool add, int stored = M) {
    const int64_t n0 = b * 16, n = w.rows - n0 < 16 ? w.rows - n0 : 16;
    float acc[M][16];  // every sum read below is written (`bf16_rows`, `packed_rows`)
    if (w.format == BF16)
        bf16_rows<M>(w, n0, n, x, m0, acc);
    else
        packed_rows<M>(w, b, x, m0, acc);
    for (int m = 0; m < stored; ++m)
        for (int r = 0; r < n; ++r) {
            const float v = acc[m][r] + (w.bias ? bf16(w.bias[n0 + r]) : 0.0f);
            float* o = out + m * ldo + n0 + r;
            *o = add ? *o + v : v;
        }
}

// Bytes of activations a pass over the weight takes (`product`): they stay in L2 while every
// block of the thread's share runs over them.
constexpr int64_t PANEL_BYTES = 1 << 18;

// out [rows][w.rows] (=|+=) x @ w.T (+ bias), sharing the blocks among the calling team (an
// orphaned worksharing loop: call it from every thread of a parallel region). The rows go in
// panels of PANEL_BYTES of activations (a prefill chunk's thousands of rows would otherwise
// stream from memory once per block); within a panel a thread runs its rows over each of its
// blocks, BLOCK_ROWS at a time (the last up to WIDE_ROWS at once), while the block is in its
// cache. A row's arithmetic is the same whatever the panels, groups and blocks of rows: only
// the order in which rows are computed changes.
// wait: end with the team's barrier (else a thread goes on as soon as its share is done).
void product(const Matrix& w, const Activations& x, int rows, float* out, int64_t ldo, bool add,
             bool wait = true) {
    const int64_t blocks = (w.rows + 15) / 16;
    const int64_t row_bytes = w.format == BF16 ? 6 * w.cols : w.cols;
    const int panel = int(std::max<int64_t>(1, PANEL_BYTES / row_bytes / BLOCK_ROWS)) * BLOCK_ROWS;
    for (int p0 = 0; p0 < rows; p0 += panel) {
        const int p1 = std::min(rows, p0 + panel);
#pragma omp for schedule(static) nowait
        for (int64_t b = 0; b < blocks; ++b) {
            for (int m0 = p0; m0 < p1; m0 += BLOCK_ROWS) {
                float* o = out + m0 * ldo;
#if defined(PYPTO_VNNI)
                if (p1 - m0 > BLOCK_ROWS && p1 - m0 <= WIDE_ROWS) {  // the last rows at once
                    static_assert(WIDE_ROWS == 10);
                    if (p1 - m0 == 9)
                        block_product<9>(w, b, x, m0, o, ldo, add);
                    else
                        block_product<10>(w, b, x, m0, o, ldo, add);
                    break;
                }
#endif
                if (w.format != BF16 && x.stride == BLOCK_ROWS && p1 - m0 >= PADDED_ROWS &&
                    p1 - m0 < BLOCK_ROWS) {
                    block_product<BLOCK_ROWS>(w, b, x, m0, o, ldo, add, p1 - m0);
                    continue;
                }
                switch (p1 - m0) {
                    case 1: block_product<1>(w, b, x, m0, o, ldo, add); break;
                    case 2: block_product<2>(w, b, x, m0, o, ldo, add); break;
                    case 3: block_product<3>(w, b, x, m0, o, ldo, add); break;
                    case 4: block_product<4>(w, b, x, m0, o, ldo, add); break;
                    case 5: block_product<5>(w, b, x, m0, o, ldo, add); break;
                    case 6: block_product<6>(w, b, x, m0, o, ldo, add); break;
                    case 7: block_product<7>(w, b, x, m0, o, ldo, add); break;
                    default: block_product<BLOCK_ROWS>(w, b, x, m0, o, ldo, add); break;
                }
            }
        }
    }
    if (wait) {
#pragma omp barrier
    }
}

}  // namespace
