// Paged attention for the CPU, reading keys and values in place from their pages (no gather
// into a padded batch): decodes (one query per sequence, memory-bound) and prefill chunks
// (many queries per sequence, causal, compute-bound), each with an online softmax in float32.
//
// Built on first use by native_attention.py (g++ -O3 -march=native -fopenmp, with the model's
// GROUP and HEAD_DIM defined) and called through ctypes. Portable C++ with GCC vector
// extensions, the vectors as wide as the CPU's registers (VW floats: 16 with AVX-512, 8 with
// AVX2, else 4). Never wider: GCC splits a vector wider than the registers badly (on AVX2 a
// 16-float vector times a scalar was built lane by lane through the stack, and e^x converted
// float to int one lane at a time: prefill attention ran 19x slower than with AVX-512).
//
// Layout, as the KV store holds it: the caches of one layer are [kv_heads, slots, row] with
// slot = page * page_size + offset; q and out are [tokens, heads, dim], query head h reading
// KV head h / GROUP (grouped-query attention without expanding K/V). A cached row is the
// token's dim values in the model's dtype, or (an int8 cache) dim int8 values followed by
// their float32 scale: the row is value * scale, a quarter (bf16: half) of the bytes to read.
// Work is split over the OpenMP team that torch itself uses. Inputs and outputs are float32
// or bfloat16; all arithmetic is float32, but for AVX512-BF16's prefill of bf16
// (`prefill_pairs`: products of bf16 pairs summed in float32, each probability weighing the
// values as a bf16 plus the bf16 of its remainder, dropped under 1/256).
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "spans.h"

namespace {

#if defined(__AVX512F__)
#define VW 16  // floats in a vector register
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4  // SSE, NEON
#endif

typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));
typedef uint16_t vh __attribute__((vector_size(VW * 2)));
typedef int8_t vc __attribute__((vector_size(VW)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

// The library is built for one model's attention shape: query heads per KV head and head_dim.
#if !defined(GROUP) || !defined(HEAD_DIM) || HEAD_DIM % 16 != 0
#error "build with -DGROUP=<query heads per KV head> -DHEAD_DIM=<a multiple of 16>"
#endif

constexpr int MAX_PAGE = 256;  // tokens per page

inline vf load(const float* p) {
    vf v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline vf load(const uint16_t* p) {  // bfloat16 -> float32: the bf16 bits are the high half
    vh h;
    std::memcpy(&h, p, sizeof h);
    vu u = __builtin_convertvector(h, vu) << 16;
    vf f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

inline float load_one(const float* p) { return *p; }

inline float load_one(const uint16_t* p) {
    const uint32_t u = uint32_t(*p) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

inline void store(uint16_t* p, vf v) {  // float32 -> bfloat16, rounding to nearest even
    vu u;
    std::memcpy(&u, &v, sizeof u);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    vh h = __builtin_convertvector(u, vh);
    std::memcpy(p, &h, sizeof h);
}

inline float hsum(vf a) {  // in registers (through memory the halves' loads would stall)
#if VW == 4
    v4f s4 = a;
#elif defined(__clang__) || __GNUC__ >= 12
#if VW == 16
    v8f s8 = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
             __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    v8f s8 = a;
#endif
    v4f s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
#else
#if VW == 16
    v8f lo, hi;
    std::memcpy(&lo, &a, sizeof lo);
    std::memcpy(&hi, reinterpret_cast<char*>(&a) + sizeof lo, sizeof hi);
    v8f s8 = lo + hi;
#else
    v8f s8 = a;
#endif
    v4f l4, h4;
    std::memcpy(&l4, &s8, sizeof l4);
    std::memcpy(&h4, reinterpret_cast<char*>(&s8) + sizeof l4, sizeof h4);
    v4f s4 = l4 + h4;
#endif
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// sums[t] = hsum(d[t]) for VW vectors at once, each by hsum's very tree (the same additions
// of the same operands, so the same bits): each level adds a pair of shuffled vectors, every
// lane one of hsum's additions for one of the vectors, where hsum itself spends two
// shuffles and a scalar tail on every vector. The last level leaves them in order.
#if (VW == 16 || VW == 8) && (defined(__clang__) || __GNUC__ >= 12)
#define LANE_SUMS 1
inline vf lane_sums(const vf* d) {
#if VW == 16
    vf one[8], two[4], three[2];
    for (int p = 0; p < 8; ++p)  // vector 2p's lanes j + (j + 8) in lanes 0-7, 2p + 1's in 8-15
        one[p] = __builtin_shufflevector(d[2 * p], d[2 * p + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17,
                                         18, 19, 20, 21, 22, 23) +
                 __builtin_shufflevector(d[2 * p], d[2 * p + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                         25, 26, 27, 28, 29, 30, 31);
    for (int q = 0; q < 4; ++q)  // each vector's j + (j + 4): vectors 4q .. 4q + 3 by quads
        two[q] = __builtin_shufflevector(one[2 * q], one[2 * q + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16,
                                         17, 18, 19, 24, 25, 26, 27) +
                 __builtin_shufflevector(one[2 * q], one[2 * q + 1], 4, 5, 6, 7, 12, 13, 14, 15,
                                         20, 21, 22, 23, 28, 29, 30, 31);
#else
    vf two[4], three[2];
    for (int q = 0; q < 4; ++q)  // each vector's j + (j + 4): vectors 2q, 2q + 1 by quads
        two[q] = __builtin_shufflevector(d[2 * q], d[2 * q + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
                 __builtin_shufflevector(d[2 * q], d[2 * q + 1], 4, 5, 6, 7, 12, 13, 14, 15);
#endif
    for (int r = 0; r < 2; ++r)  // each quad's (0 + 2) and (1 + 3), in pairs of lanes
#if VW == 16
        three[r] = __builtin_shufflevector(two[2 * r], two[2 * r + 1], 0, 1, 4, 5, 8, 9, 12, 13,
                                           16, 17, 20, 21, 24, 25, 28, 29) +
                   __builtin_shufflevector(two[2 * r], two[2 * r + 1], 2, 3, 6, 7, 10, 11, 14, 15,
                                           18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(three[0], three[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22,
                                   24, 26, 28, 30) +
           __builtin_shufflevector(three[0], three[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23,
                                   25, 27, 29, 31);
#else
        three[r] = __builtin_shufflevector(two[2 * r], two[2 * r + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
                   __builtin_shufflevector(two[2 * r], two[2 * r + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(three[0], three[1], 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(three[0], three[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}
#endif

// How a cache row reads: VW of its values from i, and the scale they are multiplied by.
template <typename C>
struct Row {  // the model's dtype
    static constexpr int STRIDE = HEAD_DIM;  // elements from one row to the next
    static vf values(const C* row, int i) { return load(row + i); }
    static float scale(const C*) { return 1.0f; }
};

template <>
struct Row<int8_t> {  // int8 values, then their float32 scale
    static constexpr int STRIDE = HEAD_DIM + 4;
    static vf values(const int8_t* row, int i) {
#if VW == 16  // GCC turns the generic widening below into scalar conversions
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i));
        return vf(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)));
#elif VW == 8 && defined(__AVX2__)
        const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i));
        return vf(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)));
#else
        vc c;
        std::memcpy(&c, row + i, sizeof c);
        return __builtin_convertvector(c, vf);
#endif
    }
    static float scale(const int8_t* row) {
        float s;
        std::memcpy(&s, row + HEAD_DIM, sizeof s);
        return s;
    }
};

// How a decode reads a cache row: Row's values in the head's order (the dims of vector i are
// i * VW .. i * VW + VW - 1), or for bfloat16 rows, where a head's vectors come in pairs
// (NV even), each 2 VW values of a pair widened by one shift or one mask of their 32-bit
// words: vector 2p holds dims 2 VW p + 2 l (the even ones, lane l), vector 2p + 1 the odd
// ones. A dot product over the head is the same whatever order its dims come in, so the
// queries are laid out alike, and the weighted values put back in order at the end. One
// integer op a vector, where the widening load (vpmovzxwd) and its shift take two.
template <typename C, int NV>
struct DecodeRow : Row<C> {
    static constexpr bool PAIRED = false;
    static int dim(int i, int lane) { return i * VW + lane; }
};

template <int NV>
struct DecodeRow<uint16_t, NV> : Row<uint16_t> {
    static constexpr bool PAIRED = NV % 2 == 0;
    static int dim(int i, int lane) {
        return PAIRED ? (i / 2) * 2 * VW + 2 * lane + i % 2 : i * VW + lane;
    }
    static vf values(const uint16_t* row, int i) {
        if constexpr (!PAIRED) {
            return load(row + i);
        } else {
            vu words;
            std::memcpy(&words, row + (i / VW / 2) * 2 * VW, sizeof words);
            words = (i / VW) % 2 ? words & 0xFFFF0000u : words << 16;
            vf f;
            std::memcpy(&f, &words, sizeof f);
            return f;
        }
    }
};

// e^x for x <= 0 (softmax after subtracting the max): 2^n * e^r with |r| <= ln2 / 2 and a
// degree-6 Taylor polynomial for e^r (relative error < 2e-7); below -87 it is 0, exactly, so
// that a masked key (or a page's padding) adds nothing at all to a row's sums: a prefill row
// then gets the same bits whichever later rows share its tile.
inline vf vexp(vf x) {
    const auto under = x < -87.0f;
    x = under ? vf{} - 87.0f : x;
    vi n = __builtin_convertvector(x * 1.44269504f - 0.5f, vi);  // round(x / ln2), x <= 0
    vf r = x - __builtin_convertvector(n, vf) * 0.693147181f;
    vf p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 +
                                                r * (1.0f / 120 + r * (1.0f / 720))))));
    vi bits = (n + 127) << 23;
    vf scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return under ? vf{} : p * scale;
}

// Asks for a cache row (S elements of C from `row`) into the cache.
template <typename C>
inline void ask_row(const C* row) {
    for (int line = 0; line < int(Row<C>::STRIDE * sizeof(C)); line += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(row) + line);
}

// The online softmax of G queries over a page's n scores s[g][0, n): each query's new running
// max m[g], its scores turned into e^(score - max) (and zeros past n to the vector's end),
// its sum l[g] and what came before (acc, [G][NV] vectors) rescaled to the new max.
template <int G, int NV>
inline void page_softmax(float (*s)[MAX_PAGE], int n, float* m, float* l, vf (*acc)[NV]) {
    for (int g = 0; g < G; ++g) {
        float mx = m[g];
        for (int t = 0; t < n; ++t) mx = s[g][t] > mx ? s[g][t] : mx;
        for (int t = n; t < (n + VW - 1) / VW * VW; ++t) s[g][t] = mx - 100.0f;  // e^-87: ~0
        vf sum{};
        for (int t = 0; t < n; t += VW) {
            vf e = vexp(load(&s[g][t]) - mx);
            store(&s[g][t], e);
            sum += e;
        }
        const float corr = vexp(vf{} + (m[g] - mx))[0];
        for (int i = 0; i < NV; ++i) acc[g][i] *= corr;
        l[g] = l[g] * corr + hsum(sum);
        m[g] = mx;
    }
}

// Attention of G query heads (one KV head's group) of one sequence; NV = head_dim / VW.
// ---- decodes: one query per sequence ----
//
// Per (sequence, KV head): the group's queries stay in registers; each page gives scores for
// its tokens (a dot product and a horizontal sum each), an online-softmax update (running max
// and sum) and the weighted sum of its values.
//
// A long context is split into spans (spans.h), each span's state a work item or a pair's
// spans one item, merged in span order.

// A span's softmax state, as floats: G running maxima, G sums, then G x HEAD_DIM weighted
// values (unnormalized, in the order the rows read: DecodeRow's).
constexpr int PART = GROUP * (HEAD_DIM + 2);

template <typename T, typename C, int G, int NV>
void decode_span(const T* q, const C* k, const C* v, const int64_t* pages, int64_t ctx,
                 int first_page, int end_page, int page_size, float scale, float* part) {
    using R = DecodeRow<C, NV>;
    constexpr int D = NV * VW, S = R::STRIDE;
    vf qs[G][NV], acc[G][NV];
    float m[G], l[G];
    alignas(64) float s[G][MAX_PAGE];
    for (int g = 0; g < G; ++g) {
        for (int i = 0; i < NV; ++i) {
            if constexpr (R::PAIRED) {  // the query's dims in the order the rows read
                alignas(64) float lanes[VW];
                for (int j = 0; j < VW; ++j) lanes[j] = load_one(q + g * D + R::dim(i, j));
                qs[g][i] = load(lanes) * scale;
            } else {
                qs[g][i] = load(q + g * D + i * VW) * scale;
            }
            acc[g][i] = vf{};
        }
        m[g] = -3.0e38f;
        l[g] = 0.0f;
    }
    for (int p = first_page; p < end_page; ++p) {
        const int64_t start = int64_t(p) * page_size;
        const int n = ctx - start < page_size ? int(ctx - start) : page_size;
        const C* kp = k + pages[p] * page_size * S;
        const C* vp = v + pages[p] * page_size * S;
        // while this page's scores are taken, its values and the next page's keys are asked
        // for (a page is a short stream the hardware prefetcher barely ramps up on; past the
        // span, for the next span's item)
        const C* next = start + page_size < ctx ? k + pages[p + 1] * page_size * S : kp;
#if defined(LANE_SUMS)
        for (int t0 = 0; t0 < n; t0 += VW) {  // scores of the page's tokens, VW at a time
            vf d[G][VW], ks{};
            for (int t = 0; t < VW; ++t) {
                if (t0 + t >= n) {  // past the page's tokens: sums nobody reads
                    for (int g = 0; g < G; ++g) d[g][t] = vf{};
                    continue;
                }
                ask_row(vp + (t0 + t) * S);
                ask_row(next + (t0 + t) * S);
                vf row[NV];
                for (int i = 0; i < NV; ++i) row[i] = R::values(kp + (t0 + t) * S, i * VW);
                ks[t] = R::scale(kp + (t0 + t) * S);
                for (int g = 0; g < G; ++g) {
                    d[g][t] = qs[g][0] * row[0];
                    for (int i = 1; i < NV; ++i) d[g][t] += qs[g][i] * row[i];
                }
            }
            for (int g = 0; g < G; ++g) store(&s[g][t0], lane_sums(d[g]) * ks);
        }
#else
        for (int t = 0; t < n; ++t) {  // scores of the page's tokens
            ask_row(vp + t * S);
            ask_row(next + t * S);
            vf row[NV];
            for (int i = 0; i < NV; ++i) row[i] = R::values(kp + t * S, i * VW);
            const float ks = R::scale(kp + t * S);
            for (int g = 0; g < G; ++g) {
                vf d = qs[g][0] * row[0];
                for (int i = 1; i < NV; ++i) d += qs[g][i] * row[i];
                s[g][t] = hsum(d) * ks;
            }
        }
#endif
        page_softmax<G, NV>(s, n, m, l, acc);
        for (int t = 0; t < n; ++t) {  // weighted values
            vf row[NV];
            for (int i = 0; i < NV; ++i) row[i] = R::values(vp + t * S, i * VW);
            const float vs = R::scale(vp + t * S);
            for (int g = 0; g < G; ++g) {
                const float w = s[g][t] * vs;
                for (int i = 0; i < NV; ++i) acc[g][i] += w * row[i];
            }
        }
    }
    for (int g = 0; g < G; ++g) {
        part[g] = m[g];
        part[G + g] = l[g];
        for (int i = 0; i < NV; ++i) store(part + 2 * G + (g * NV + i) * VW, acc[g][i]);
    }
}

// out [G][D] = the spans' states merged, in span order: each rescaled to the largest max.
template <typename T, typename C, int G, int NV>
void merge_spans(const float* parts, int spans, T* out) {
    using R = DecodeRow<C, NV>;
    constexpr int D = NV * VW;
    for (int g = 0; g < G; ++g) {
        float top = parts[g];
        for (int j = 1; j < spans; ++j) top = std::max(top, parts[j * PART + g]);
        vf acc[NV] = {};
        float l = 0.0f;
        for (int j = 0; j < spans; ++j) {
            const float* part = parts + j * PART;
            const float corr = vexp(vf{} + (part[g] - top))[0];  // 1 for the top one
            l += part[G + g] * corr;
            for (int i = 0; i < NV; ++i) acc[i] += load(part + 2 * G + (g * NV + i) * VW) * corr;
        }
        const float inv = 1.0f / l;
        if constexpr (R::PAIRED) {  // the dims back in the head's order
            alignas(64) float head[D];
            for (int i = 0; i < NV; ++i) {
                alignas(64) float lanes[VW];
                store(lanes, acc[i] * inv);
                for (int j = 0; j < VW; ++j) head[R::dim(i, j)] = lanes[j];
            }
            for (int i = 0; i < NV; ++i) store(out + g * D + i * VW, load(head + i * VW));
        } else {
            for (int i = 0; i < NV; ++i) store(out + g * D + i * VW, acc[i] * inv);
        }
    }
}

template <typename T, typename C>
void decode(const T* q, const C* k, const C* v, const int64_t* block_table,
            const int64_t* ctx_lens, T* out, int batch, int heads, int kv_heads, int width,
            int page_size, int64_t head_stride, float scale) {
    constexpr int NV = HEAD_DIM / VW;
    spans::Plan plan;
    plan.plan(ctx_lens, batch, kv_heads, page_size, omp_get_max_threads(), PART);
    std::vector<float> states(plan.state_floats());
    auto at = [&](int b, int h) { return (int64_t(b) * heads + int64_t(h) * GROUP) * HEAD_DIM; };
    auto span = [&](int b, int h, int j) {
        decode_span<T, C, GROUP, NV>(q + at(b, h), k + h * head_stride, v + h * head_stride,
                                     block_table + int64_t(b) * width, ctx_lens[b],
                                     plan.from(b, j), plan.end(b, j), page_size, scale,
                                     &states[plan.state(b, h) + j * PART]);
    };
    auto merge = [&](int b, int h) {
        merge_spans<T, C, GROUP, NV>(&states[plan.state(b, h)], plan.spans(b),
                                     out + at(b, h));
    };
#pragma omp parallel
    {
        if (plan.split) {  // every span an item, then the merges
#pragma omp for schedule(dynamic, 1)
            for (int item = 0; item < plan.total() * kv_heads; ++item) {
                const int b = plan.row_of(item / kv_heads);
                span(b, item % kv_heads, item / kv_heads - plan.first[b]);
            }
#pragma omp for schedule(static)
            for (int item = 0; item < batch * kv_heads; ++item)
                merge(item / kv_heads, item % kv_heads);
        } else {  // a (sequence, KV head) pair's spans one item
#pragma omp for schedule(dynamic, 1)
            for (int item = 0; item < batch * kv_heads; ++item) {
                const int b = item / kv_heads, h = item % kv_heads;
                for (int j = 0; j < plan.spans(b); ++j) span(b, h, j);
                merge(b, h);
            }
        }
    }
}

// ---- prefill chunks: many queries per sequence, causal over the pages in place ----
//
// A work item is a tile of a sequence's query tokens for one KV head. Its rows are the
// (token, query head of the group) pairs, ROWS of them, held transposed so that the rows lie
// across the vector lanes: scores are [key][row], and the running max, sum and output are
// per lane. Each key page is converted to float32 once per tile (float32 pages are read where
// they lie); its scores, causal mask, online-softmax update and weighted values are all
// broadcast-FMAs over row vectors (no horizontal sums). Pages past the tile's last query are
// never read.

// The register blocks are sized to the register file: 32 vector registers with AVX-512 (and
// NEON), 16 with AVX2 or SSE, so that the accumulators, the loaded operands and a broadcast fit.
constexpr int RV = 4;             // row vectors of a tile
constexpr int ROWS = RV * VW;     // rows of a tile: tokens * group, padded to the vectors
#if VW == 16
constexpr int KB = 4, DB = 16;    // keys a block of scores, value dims a block of outputs
#else
constexpr int KB = 2, DB = 8;
#endif
static_assert(ROWS >= GROUP, "a tile holds at least one token");
constexpr float MASKED = -1.0e30f;

struct Scratch {  // per thread, reused by every tile it runs
    float qt[HEAD_DIM][ROWS], ot[HEAD_DIM][ROWS], st[MAX_PAGE][ROWS];
    float keys[MAX_PAGE][HEAD_DIM], values[MAX_PAGE][HEAD_DIM], row[HEAD_DIM];
    // prefill_pairs': the queries as bf16 pairs of dims [pair][row], the probabilities as
    // bf16 pairs of keys [pair][row] (p2) with their remainders' (p2lo), a page's values as
    // bf16 pairs of keys [pair][dim]
    uint32_t q2[HEAD_DIM / 2][ROWS], p2[MAX_PAGE / 2][ROWS], p2lo[MAX_PAGE / 2][ROWS];
    uint32_t v2[MAX_PAGE / 2][HEAD_DIM];
    bool any_lo[MAX_PAGE / 2];  // whether a pair of p2lo has a remainder that is not zero
};

template <typename T>
void to_float(const T* src, float* dst, int n) {  // n values, n a multiple of VW
    for (int i = 0; i < n; i += VW) store(dst + i, load(src + i));
}

// n cache rows as float32 [n][HEAD_DIM]: converted into dst, or float32 rows where they lie.
template <typename C>
const float* rows_to_float(const C* src, float* dst, int n) {
    using R = Row<C>;
    for (int t = 0; t < n; ++t) {
        const float scale = R::scale(src + t * R::STRIDE);
        for (int i = 0; i < HEAD_DIM; i += VW)
            store(dst + t * HEAD_DIM + i, R::values(src + t * R::STRIDE, i) * scale);
    }
    return dst;
}

template <>
const float* rows_to_float(const float* src, float*, int) { return src; }

// A tile's rows' token positions (padding rows: the last row's), running maxima and sums.
inline void tile_rows(int rows, int64_t first, vf* pos, vf* m, vf* l) {
    for (int j = 0; j < RV; ++j) {
        for (int i = 0; i < VW; ++i) {
            const int r = j * VW + i < rows ? j * VW + i : rows - 1;  // padding: the last row
            pos[j][i] = float(first + r / GROUP);
        }
        m[j] = vf{} - 3.0e38f;
        l[j] = vf{};
    }
}

// The causal mask over a page's n scores in w.st (keys from position start): a key after a
// row's own position scores MASKED (nothing to do where every key is at or before `first`).
inline void mask_later_keys(Scratch& w, int n, int64_t start, int64_t first, const vf* pos) {
    if (start + n - 1 <= first) return;
    for (int t = 0; t < n; ++t)
        for (int j = 0; j < RV; ++j) {
            vf s = load(&w.st[t][j * VW]);
            store(&w.st[t][j * VW], float(start + t) > pos[j] ? vf{} + MASKED : s);
        }
}

// The online softmax of rows j * VW .. across the lanes over a page's n scores in w.st:
// they become e^(score - max), m and l are updated, and the factor that rescales what the
// rows summed before is returned.
inline vf lane_softmax(Scratch& w, int j, int n, vf& m, vf& l) {
    vf mx = m;
    for (int t = 0; t < n; ++t) {
        vf s = load(&w.st[t][j * VW]);
        mx = s > mx ? s : mx;
    }
    const vf corr = vexp(m - mx);
    vf sum{};
    for (int t = 0; t < n; ++t) {
        vf e = vexp(load(&w.st[t][j * VW]) - mx);
        store(&w.st[t][j * VW], e);
        sum += e;
    }
    l = l * corr + sum;
    m = mx;
    return corr;
}

// The tile's outputs (w.ot, [dim][row]) transposed back into out, each row divided by its sum.
template <typename T>
void write_rows(Scratch& w, const vf* l, int rows, T* out, int64_t token_stride) {
    for (int r = 0; r < rows; ++r) {
        const float inv = 1.0f / l[r / VW][r % VW];
        for (int d = 0; d < HEAD_DIM; ++d) w.row[d] = w.ot[d][r] * inv;
        T* dst = out + (r / GROUP) * token_stride + (r % GROUP) * HEAD_DIM;
        for (int d = 0; d < HEAD_DIM; d += VW) store(dst + d, load(w.row + d));
    }
}

// Rows r = token * GROUP + g of `tokens` query tokens at positions first, first + 1, ...;
// q and out point at the group's first query head of the tile's first token; consecutive
// tokens are `token_stride` apart.
template <typename T, typename C>
void prefill_tile(Scratch& w, const T* q, T* out, int64_t token_stride, int tokens,
                  int64_t first, const C* k, const C* v, const int64_t* pages, int page_size,
                  float scale) {
    constexpr int D = HEAD_DIM;
    const int rows = tokens * GROUP;
    for (int r = 0; r < rows; ++r) {  // transpose the queries in, scaled
        to_float(q + (r / GROUP) * token_stride + (r % GROUP) * D, w.row, D);
        for (int d = 0; d < D; ++d) w.qt[d][r] = w.row[d] * scale;
    }
    for (int d = 0; d < D; ++d) {
        for (int r = rows; r < ROWS; ++r) w.qt[d][r] = 0.0f;
        for (int r = 0; r < ROWS; ++r) w.ot[d][r] = 0.0f;
    }
    vf pos[RV], m[RV], l[RV];  // each row's token position, running max and sum
    tile_rows(rows, first, pos, m, l);
    const int64_t last = first + tokens - 1;
    for (int64_t start = 0, p = 0; start <= last; start += page_size, ++p) {
        const int n = last + 1 - start < page_size ? int(last + 1 - start) : page_size;
        const int64_t at = pages[p] * page_size * Row<C>::STRIDE;
        const float* keys = rows_to_float(k + at, &w.keys[0][0], n);
        const float* values = rows_to_float(v + at, &w.values[0][0], n);
        int t = 0;
        for (; t + KB <= n; t += KB) {  // scores, KB keys at a time
            vf acc[KB][RV] = {};
            for (int d = 0; d < D; ++d) {
                vf qv[RV];
                for (int j = 0; j < RV; ++j) qv[j] = load(&w.qt[d][j * VW]);
                for (int i = 0; i < KB; ++i)
                    for (int j = 0; j < RV; ++j) acc[i][j] += keys[(t + i) * D + d] * qv[j];
            }
            for (int i = 0; i < KB; ++i)
                for (int j = 0; j < RV; ++j) store(&w.st[t + i][j * VW], acc[i][j]);
        }
        for (; t < n; ++t) {
            vf acc[RV] = {};
            for (int d = 0; d < D; ++d)
                for (int j = 0; j < RV; ++j) acc[j] += keys[t * D + d] * load(&w.qt[d][j * VW]);
            for (int j = 0; j < RV; ++j) store(&w.st[t][j * VW], acc[j]);
        }
        mask_later_keys(w, n, start, first, pos);
        for (int j = 0; j < RV; ++j) {  // online softmax across the lanes
            const vf corr = lane_softmax(w, j, n, m[j], l[j]);
            for (int d0 = 0; d0 < D; d0 += DB) {  // weighted values, DB dims at a time
                vf acc[DB];
                for (int i = 0; i < DB; ++i) acc[i] = load(&w.ot[d0 + i][j * VW]) * corr;
                for (int t = 0; t < n; ++t) {
                    const vf pv = load(&w.st[t][j * VW]);
                    for (int i = 0; i < DB; ++i) acc[i] += values[t * D + d0 + i] * pv;
                }
                for (int i = 0; i < DB; ++i) store(&w.ot[d0 + i][j * VW], acc[i]);
            }
        }
    }
    write_rows(w, l, rows, out, token_stride);
}

#if defined(__AVX512BF16__) && VW == 16
#define PREFILL_PAIRS 1
// bf16 pairs: lane i holds even[i] rounded to bf16 in its low half, odd[i] in its high half
inline __m512i pack_pairs(__m512 even, __m512 odd) {
    const __m512i e = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(even));
    const __m512i o = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(odd));
    return _mm512_or_si512(e, _mm512_slli_epi32(o, 16));
}
inline __m512 pair_even(__m512i p) { return _mm512_castsi512_ps(_mm512_slli_epi32(p, 16)); }
inline __m512 pair_odd(__m512i p) {
    return _mm512_castsi512_ps(_mm512_and_si512(p, _mm512_set1_epi32(int(0xffff0000u))));
}
// what rounding a probability p (at most 1) to bf16 left, kept where p >= 1/256: below, it is
// under 2^-17 of the row's largest weight, and dropping it lets whole pairs skip a product
inline __m512 remainder(__m512 p, __m512 rounded) {
    const __mmask16 kept = _mm512_cmp_ps_mask(p, _mm512_set1_ps(1.0f / 256), _CMP_GE_OQ);
    return _mm512_maskz_sub_ps(kept, p, rounded);
}

// prefill_tile for bf16 queries over a bf16 cache with AVX512-BF16 pair dot products
// (vdpbf16ps: two products a lane an instruction, where an FMA takes one): the scores sum the
// query's and the key's bf16 dims in pairs, exactly as stored, and the weighted values sum
// keys in pairs against the values as stored, each float32 probability as its bf16 plus the
// bf16 of what that rounding left (16 bits of mantissa where one bf16 keeps 8). Rounding the
// probabilities to one bf16, as GPU flash attention and PyTorch's CPU path do, added about a
// tenth to the error against float64 and moved a tiny MoE model's prompt logprobs past its
// test's bound; the remainders of probabilities under 1/256 of the running maximum are
// dropped, so the pairs of keys that real text weighs lightly (most of a long context) cost
// one product as with a single bf16. The softmax and the sums stay float32; a row's
// arithmetic is its lane's alone, and pairs of keys are pairs of a page's slots, so its result
// does not depend on the tile, chunk or batch it came in.
void prefill_pairs(Scratch& w, const uint16_t* q, uint16_t* out, int64_t token_stride,
                   int tokens, int64_t first, const uint16_t* k, const uint16_t* v,
                   const int64_t* pages, int page_size, float scale) {
    constexpr int D = HEAD_DIM, DP = D / 2;
    const int rows = tokens * GROUP;
    for (int r = 0; r < ROWS; ++r) {  // transpose the queries in, as pairs of dims
        for (int i = 0; i < DP; ++i) {
            uint32_t pair = 0;  // padding rows: zeros
            if (r < rows)
                std::memcpy(&pair, q + (r / GROUP) * token_stride + (r % GROUP) * D + 2 * i,
                            sizeof pair);
            w.q2[i][r] = pair;
        }
    }
    for (int d = 0; d < D; ++d)
        for (int r = 0; r < ROWS; ++r) w.ot[d][r] = 0.0f;
    vf pos[RV], m[RV], l[RV];
    tile_rows(rows, first, pos, m, l);
    // the values' pairs: slot 2t's dims interleaved with slot 2t + 1's, in the dims' order
    const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10,
                                            41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3,
                                            34, 2, 33, 1, 32, 0);
    const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
    const int64_t last = first + tokens - 1;
    for (int64_t start = 0, p = 0; start <= last; start += page_size, ++p) {
        const int n = last + 1 - start < page_size ? int(last + 1 - start) : page_size;
        const uint16_t* kp = k + pages[p] * page_size * D;
        const uint16_t* vp = v + pages[p] * page_size * D;
        int t = 0;
        for (; t < n; t += KB) {  // scores, KB keys at a time (the last block padded)
            __m512 acc[KB][RV];
            const uint32_t* key[KB];
            for (int b = 0; b < KB; ++b) {
                key[b] = reinterpret_cast<const uint32_t*>(kp + (t + b < n ? t + b : t) * D);
                for (int j = 0; j < RV; ++j) acc[b][j] = _mm512_setzero_ps();
            }
            for (int i = 0; i < DP; ++i) {
                __m512bh qv[RV];
                for (int j = 0; j < RV; ++j)
                    qv[j] = (__m512bh)_mm512_loadu_si512(&w.q2[i][j * VW]);
                for (int b = 0; b < KB; ++b) {
                    const __m512bh kb = (__m512bh)_mm512_set1_epi32(int(key[b][i]));
                    for (int j = 0; j < RV; ++j) acc[b][j] = _mm512_dpbf16_ps(acc[b][j], qv[j], kb);
                }
            }
            for (int b = 0; b < KB && t + b < n; ++b)
                for (int j = 0; j < RV; ++j) store(&w.st[t + b][j * VW], vf(acc[b][j]) * scale);
        }
        mask_later_keys(w, n, start, first, pos);
        const int np = (n + 1) / 2;  // pairs of keys (an odd last key paired with zeros)
        for (int tp = 0; tp < np; ++tp) {
            const bool whole = 2 * tp + 1 < n;
            for (int d = 0; d < D; d += 32) {
                const __m512i a = _mm512_loadu_si512(vp + 2 * tp * D + d);
                const __m512i b = whole ? _mm512_loadu_si512(vp + (2 * tp + 1) * D + d)
                                        : _mm512_setzero_si512();
                _mm512_storeu_si512(&w.v2[tp][d], _mm512_permutex2var_epi16(a, lo_idx, b));
                _mm512_storeu_si512(&w.v2[tp][d + 16], _mm512_permutex2var_epi16(a, hi_idx, b));
            }
        }
        for (int j = 0; j < RV; ++j) {  // online softmax across the lanes
            const vf corr = lane_softmax(w, j, n, m[j], l[j]);
            for (int tp = 0; tp < np; ++tp) {  // the probabilities as bf16 pairs, and remainders
                const __m512 even = __m512(load(&w.st[2 * tp][j * VW]));
                const __m512 odd =
                    2 * tp + 1 < n ? __m512(load(&w.st[2 * tp + 1][j * VW])) : _mm512_setzero_ps();
                const __m512i hi = pack_pairs(even, odd);
                const __m512i lo = pack_pairs(remainder(even, pair_even(hi)),
                                              remainder(odd, pair_odd(hi)));
                _mm512_storeu_si512(&w.p2[tp][j * VW], hi);
                _mm512_storeu_si512(&w.p2lo[tp][j * VW], lo);
                w.any_lo[tp] = _mm512_test_epi32_mask(lo, lo) != 0;
            }
            for (int d0 = 0; d0 < D; d0 += DB) {  // weighted values, DB dims at a time
                __m512 acc[DB];
                for (int i = 0; i < DB; ++i) acc[i] = __m512(load(&w.ot[d0 + i][j * VW]) * corr);
                for (int tp = 0; tp < np; ++tp) {
                    const __m512bh ph = (__m512bh)_mm512_loadu_si512(&w.p2[tp][j * VW]);
                    const __m512bh pl = (__m512bh)_mm512_loadu_si512(&w.p2lo[tp][j * VW]);
                    const uint32_t* vals = &w.v2[tp][d0];
                    if (w.any_lo[tp]) {  // (skipping zeros changes no bit of the sums)
                        for (int i = 0; i < DB; ++i) {
                            const __m512bh vv = (__m512bh)_mm512_set1_epi32(int(vals[i]));
                            acc[i] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[i], pl, vv), ph, vv);
                        }
                    } else {
                        for (int i = 0; i < DB; ++i)
                            acc[i] = _mm512_dpbf16_ps(
                                acc[i], ph, (__m512bh)_mm512_set1_epi32(int(vals[i])));
                    }
                }
                for (int i = 0; i < DB; ++i) store(&w.ot[d0 + i][j * VW], vf(acc[i]));
            }
        }
    }
    write_rows(w, l, rows, out, token_stride);
}
#endif

template <typename T, typename C>
void prefill(const T* q, const C* k, const C* v, const int64_t* block_table,
             const int64_t* q_lens, const int64_t* ctx_lens, T* out, int batch, int heads,
             int kv_heads, int width, int page_size, int64_t head_stride, float scale) {
    constexpr int tile = ROWS / GROUP;  // query tokens a tile
    struct Item { int b; int64_t token; };  // a sequence, and its tile's first token
    std::vector<Item> items;
    std::vector<int64_t> q_start(batch);
    for (int b = 0, at = 0; b < batch; at += q_lens[b], ++b) {
        q_start[b] = at;
        for (int64_t i = 0; i < q_lens[b]; i += tile) items.push_back({b, i});
    }
    // costliest first (the most keys: late tiles of long contexts), for the dynamic schedule
    std::sort(items.begin(), items.end(), [&](const Item& x, const Item& y) {
        return ctx_lens[x.b] - q_lens[x.b] + x.token > ctx_lens[y.b] - q_lens[y.b] + y.token;
    });
    const int64_t token_stride = int64_t(heads) * HEAD_DIM;
    const int count = int(items.size()) * kv_heads;
#pragma omp parallel
    {
        thread_local std::unique_ptr<Scratch> w(new Scratch);  // once per thread
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < count; ++i) {
            const Item it = items[i / kv_heads];
            const int h = i % kv_heads;
            const int tokens = int(std::min<int64_t>(tile, q_lens[it.b] - it.token));
            const int64_t at = (q_start[it.b] + it.token) * token_stride + h * GROUP * HEAD_DIM;
#if defined(PREFILL_PAIRS)
            if constexpr (std::is_same_v<T, uint16_t> && std::is_same_v<C, uint16_t>) {
                prefill_pairs(*w, q + at, out + at, token_stride, tokens,
                              ctx_lens[it.b] - q_lens[it.b] + it.token, k + h * head_stride,
                              v + h * head_stride, block_table + int64_t(it.b) * width,
                              page_size, scale);
                continue;
            }
#endif
            prefill_tile(*w, q + at, out + at, token_stride, tokens,
                         ctx_lens[it.b] - q_lens[it.b] + it.token, k + h * head_stride,
                         v + h * head_stride, block_table + int64_t(it.b) * width, page_size,
                         scale);
        }
    }
}

template <typename T, typename C>
int attend(const void* q, const void* k, const void* v, const int64_t* block_table,
           const int64_t* q_lens, const int64_t* ctx_lens, void* out, int batch, int heads,
           int kv_heads, int dim, int width, int page_size, int64_t head_stride, float scale) {
    if (kv_heads <= 0 || heads != kv_heads * GROUP || dim != HEAD_DIM || page_size <= 0 ||
        page_size > MAX_PAGE)
        return 1;
    const T* qt = static_cast<const T*>(q);
    const C *kt = static_cast<const C*>(k), *vt = static_cast<const C*>(v);
    if (q_lens == nullptr)
        decode(qt, kt, vt, block_table, ctx_lens, static_cast<T*>(out), batch, heads, kv_heads,
               width, page_size, head_stride, scale);
    else
        prefill(qt, kt, vt, block_table, q_lens, ctx_lens, static_cast<T*>(out), batch, heads,
                kv_heads, width, page_size, head_stride, scale);
    return 0;
}

}  // namespace

// Attention of a step's sequences of one kind, over their pages in one layer's caches
// [kv_heads, slots, row] (head_stride = slots * row elements apart), through block_table
// [batch, width]. q and out are [tokens, heads, dim], each sequence's tokens after the
// previous one's, the last of them at position ctx_lens[b] - 1. q_lens null: decodes, one
// token per sequence; else prefill chunks of q_lens[b] tokens. dtype: 0 float32, 1 bfloat16;
// kv_int8: the caches hold int8 rows (else rows of dtype). Returns 0, or 1 for a shape the
// library was not built for.
extern "C" int pypto_paged_attention(int dtype, int kv_int8, const void* q, const void* k,
                                     const void* v, const int64_t* block_table,
                                     const int64_t* q_lens, const int64_t* ctx_lens, void* out,
                                     int batch, int heads, int kv_heads, int dim, int width,
                                     int page_size, int64_t head_stride, float scale) {
    auto run = dtype == 0 ? (kv_int8 ? attend<float, int8_t> : attend<float, float>)
             : dtype == 1 ? (kv_int8 ? attend<uint16_t, int8_t> : attend<uint16_t, uint16_t>)
                          : nullptr;
    if (run == nullptr) return 1;
    return run(q, k, v, block_table, q_lens, ctx_lens, out, batch, heads, kv_heads, dim, width,
               page_size, head_stride, scale);
}

// Write a step's new keys and values into their slots: k and v are [tokens, kv_heads, dim]
// with heads dim apart and tokens k_stride / v_stride apart (views into the projections'
// outputs), the caches as above; element_size is 4 (float32) or 2 (bfloat16).
extern "C" void pypto_store_kv(int element_size, const void* k, const void* v, void* k_cache,
                               void* v_cache, const int64_t* slots, int tokens, int kv_heads,
                               int64_t k_stride, int64_t v_stride, int64_t head_stride) {
    const int64_t row = int64_t(HEAD_DIM) * element_size;
    const char *ks = static_cast<const char*>(k), *vs = static_cast<const char*>(v);
    char *kc = static_cast<char*>(k_cache), *vc = static_cast<char*>(v_cache);
    for (int t = 0; t < tokens; ++t)
        for (int h = 0; h < kv_heads; ++h) {
            const int64_t at = int64_t(h) * HEAD_DIM;
            const int64_t dst = (h * head_stride + slots[t] * HEAD_DIM) * element_size;
            std::memcpy(kc + dst, ks + (t * k_stride + at) * element_size, row);
            std::memcpy(vc + dst, vs + (t * v_stride + at) * element_size, row);
        }
}

// The same into int8 caches: each row is quantized to int8 with a scale of its largest
// magnitude / 127 (stored after its values), rounding to nearest. dtype as above.
template <typename T>
void store_int8(const T* src, int8_t* dst) {
    vf x[HEAD_DIM / VW];
    vf top{};
    for (int i = 0; i < HEAD_DIM / VW; ++i) {
        x[i] = load(src + i * VW);
        const vf a = x[i] < 0 ? -x[i] : x[i];
        top = a > top ? a : top;
    }
    float amax = 0.0f;
    for (int i = 0; i < VW; ++i) amax = top[i] > amax ? top[i] : amax;
    const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int i = 0; i < HEAD_DIM / VW; ++i) {
        const vf r = x[i] * inv;
        const vi n = __builtin_convertvector(r + (r < 0 ? vf{} - 0.5f : vf{} + 0.5f), vi);
#if VW == 16  // as in Row<int8_t>::values
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i * VW),
                         _mm512_cvtepi32_epi8(reinterpret_cast<__m512i>(n)));
#elif VW == 8 && defined(__AVX2__)  // |n| <= 127: the saturating packs are exact
        const __m256i n32 = reinterpret_cast<__m256i>(n);
        const __m128i n16 = _mm_packs_epi32(_mm256_castsi256_si128(n32),
                                            _mm256_extracti128_si256(n32, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + i * VW), _mm_packs_epi16(n16, n16));
#else
        const vc c = __builtin_convertvector(n, vc);
        std::memcpy(dst + i * VW, &c, sizeof c);
#endif
    }
    std::memcpy(dst + HEAD_DIM, &scale, sizeof scale);
}

extern "C" void pypto_store_kv_int8(int dtype, const void* k, const void* v, void* k_cache,
                                    void* v_cache, const int64_t* slots, int tokens,
                                    int kv_heads, int64_t k_stride, int64_t v_stride,
                                    int64_t head_stride) {
    constexpr int64_t S = Row<int8_t>::STRIDE;
    int8_t *kc = static_cast<int8_t*>(k_cache), *vc = static_cast<int8_t*>(v_cache);
    for (int t = 0; t < tokens; ++t)
        for (int h = 0; h < kv_heads; ++h) {
            const int64_t dst = h * head_stride + slots[t] * S, at = int64_t(h) * HEAD_DIM;
            if (dtype == 0) {
                store_int8(static_cast<const float*>(k) + t * k_stride + at, kc + dst);
                store_int8(static_cast<const float*>(v) + t * v_stride + at, vc + dst);
            } else {
                store_int8(static_cast<const uint16_t*>(k) + t * k_stride + at, kc + dst);
                store_int8(static_cast<const uint16_t*>(v) + t * v_stride + at, vc + dst);
            }
        }
}

// ---- for the fused decode step (decode.cpp): one KV head of one sequence at a time ----

// Write one token's key and value (float32, HEAD_DIM each) of one KV head into `slot` of
// that head's caches [slots][row]: bfloat16 rows rounded to nearest even, or int8 rows
// quantized as pypto_store_kv_int8 does.
extern "C" void pypto_store_kv_head(int kv_int8, const float* k, const float* v, void* k_cache,
                                    void* v_cache, int64_t slot) {
    if (kv_int8) {
        constexpr int64_t S = Row<int8_t>::STRIDE;
        store_int8(k, static_cast<int8_t*>(k_cache) + slot * S);
        store_int8(v, static_cast<int8_t*>(v_cache) + slot * S);
        return;
    }
    uint16_t *kc = static_cast<uint16_t*>(k_cache) + slot * HEAD_DIM;
    uint16_t *vc = static_cast<uint16_t*>(v_cache) + slot * HEAD_DIM;
    for (int i = 0; i < HEAD_DIM; i += VW) {
        store(kc + i, load(k + i));
        store(vc + i, load(v + i));
    }
}

// One decode's attention for the GROUP query heads of one KV head, a span at a time (the
// fused step's, decode.cpp, through the plan of spans.h): q [GROUP][HEAD_DIM] float32, k and
// v that head's bfloat16 or int8 caches [slots][row], the sequence's pages and its context
// length (the new token included). `pypto_decode_attention_span` gives one span's state (PART
// floats: `pypto_decode_part_floats`) for pages [first_page, end_page), and
// `pypto_decode_attention_merge` out [GROUP][HEAD_DIM] from them all.
extern "C" int pypto_decode_part_floats() { return PART; }

extern "C" void pypto_decode_attention_span(int kv_int8, const float* q, const void* k,
                                            const void* v, const int64_t* pages, int64_t ctx,
                                            int first_page, int end_page, int page_size,
                                            float scale, float* part) {
    constexpr int NV = HEAD_DIM / VW;
    if (kv_int8)
        decode_span<float, int8_t, GROUP, NV>(q, static_cast<const int8_t*>(k),
                                              static_cast<const int8_t*>(v), pages, ctx,
                                              first_page, end_page, page_size, scale, part);
    else
        decode_span<float, uint16_t, GROUP, NV>(q, static_cast<const uint16_t*>(k),
                                                static_cast<const uint16_t*>(v), pages, ctx,
                                                first_page, end_page, page_size, scale, part);
}

extern "C" void pypto_decode_attention_merge(int kv_int8, const float* parts, int spans,
                                             float* out) {
    constexpr int NV = HEAD_DIM / VW;
    if (kv_int8)
        merge_spans<float, int8_t, GROUP, NV>(parts, spans, out);
    else
        merge_spans<float, uint16_t, GROUP, NV>(parts, spans, out);
}
