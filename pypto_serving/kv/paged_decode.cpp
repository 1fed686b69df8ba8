// Paged decode attention for the CPU: one query token per sequence, attending over the
// sequence's keys and values read in place from their pages (no gather into a padded batch).
//
// Built on first use by paged_decode.py (g++ -O3 -march=native -fopenmp, with the model's
// GROUP and HEAD_DIM defined) and called through ctypes. Portable C++ with GCC vector
// extensions: the compiler maps the 16-float vectors onto whatever the CPU has (one AVX-512
// register, two AVX2 registers, four NEON registers).
//
// Layout, as the KV store holds it: the caches of one layer are [kv_heads, slots, dim] with
// slot = page * page_size + offset; q and out are [batch, heads, dim], query head h reading KV
// head h / (heads / kv_heads) (grouped-query attention without expanding K/V).
//
// Per (sequence, KV head), in parallel over the OpenMP team that torch itself uses: the
// group's queries stay in registers; each page gives scores for its tokens, an online-softmax
// update (float32, running max and sum) and the weighted sum of its values. Inputs and
// outputs are float32 or bfloat16; all arithmetic is float32.
#include <cstdint>
#include <cstring>

namespace {

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

// The library is built for one model's attention shape: query heads per KV head and head_dim.
#if !defined(GROUP) || !defined(HEAD_DIM) || HEAD_DIM % 16 != 0
#error "build with -DGROUP=<query heads per KV head> -DHEAD_DIM=<a multiple of 16>"
#endif

constexpr int MAX_PAGE = 256;  // tokens per page

inline v16f load(const float* p) {
    v16f v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline v16f load(const uint16_t* p) {  // bfloat16 -> float32: the bf16 bits are the high half
    v16h h;
    std::memcpy(&h, p, sizeof h);
    v16u u = __builtin_convertvector(h, v16u) << 16;
    v16f f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

inline void store(float* p, v16f v) { std::memcpy(p, &v, sizeof v); }

inline void store(uint16_t* p, v16f v) {  // float32 -> bfloat16, rounding to nearest even
    v16u u;
    std::memcpy(&u, &v, sizeof u);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    v16h h = __builtin_convertvector(u, v16h);
    std::memcpy(p, &h, sizeof h);
}

inline float hsum(v16f a) {
    v8f lo, hi;
    std::memcpy(&lo, &a, sizeof lo);
    std::memcpy(&hi, reinterpret_cast<char*>(&a) + sizeof lo, sizeof hi);
    v8f s8 = lo + hi;
    v4f l4, h4;
    std::memcpy(&l4, &s8, sizeof l4);
    std::memcpy(&h4, reinterpret_cast<char*>(&s8) + sizeof l4, sizeof h4);
    v4f s4 = l4 + h4;
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// e^x for x <= 0 (softmax after subtracting the max): 2^n * e^r with |r| <= ln2 / 2 and a
// degree-6 Taylor polynomial for e^r (relative error < 2e-7); below -87 it flushes to ~0.
inline v16f vexp(v16f x) {
    x = x < -87.0f ? v16f{} - 87.0f : x;
    v16i n = __builtin_convertvector(x * 1.44269504f - 0.5f, v16i);  // round(x / ln2), x <= 0
    v16f r = x - __builtin_convertvector(n, v16f) * 0.693147181f;
    v16f p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 +
                                                r * (1.0f / 120 + r * (1.0f / 720))))));
    v16i bits = (n + 127) << 23;
    v16f scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

// Attention of G query heads (one KV head's group) of one sequence; NV = head_dim / 16.
template <typename T, int G, int NV>
void attend_one(const T* q, const T* k, const T* v, const int64_t* pages, int64_t ctx, T* out,
                int page_size, float scale) {
    constexpr int D = NV * 16;
    v16f qs[G][NV], acc[G][NV];
    float m[G], l[G];
    alignas(64) float s[G][MAX_PAGE];
    for (int g = 0; g < G; ++g) {
        for (int i = 0; i < NV; ++i) {
            qs[g][i] = load(q + g * D + i * 16) * scale;
            acc[g][i] = v16f{};
        }
        m[g] = -3.0e38f;
        l[g] = 0.0f;
    }
    for (int64_t start = 0, p = 0; start < ctx; start += page_size, ++p) {
        const int n = ctx - start < page_size ? int(ctx - start) : page_size;
        const T* kp = k + pages[p] * page_size * D;
        const T* vp = v + pages[p] * page_size * D;
        for (int t = 0; t < n; ++t) {  // scores of the page's tokens
            v16f row[NV];
            for (int i = 0; i < NV; ++i) row[i] = load(kp + t * D + i * 16);
            for (int g = 0; g < G; ++g) {
                v16f d = qs[g][0] * row[0];
                for (int i = 1; i < NV; ++i) d += qs[g][i] * row[i];
                s[g][t] = hsum(d);
            }
        }
        for (int g = 0; g < G; ++g) {  // online softmax: new max, rescale what came before
            float mx = m[g];
            for (int t = 0; t < n; ++t) mx = s[g][t] > mx ? s[g][t] : mx;
            for (int t = n; t < (n + 15) / 16 * 16; ++t) s[g][t] = mx - 100.0f;  // e^-87: ~0
            v16f sum{};
            for (int t = 0; t < n; t += 16) {
                v16f e = vexp(load(&s[g][t]) - mx);
                store(&s[g][t], e);
                sum += e;
            }
            const float corr = vexp(v16f{} + (m[g] - mx))[0];
            for (int i = 0; i < NV; ++i) acc[g][i] *= corr;
            l[g] = l[g] * corr + hsum(sum);
            m[g] = mx;
        }
        for (int t = 0; t < n; ++t) {  // weighted values
            v16f row[NV];
            for (int i = 0; i < NV; ++i) row[i] = load(vp + t * D + i * 16);
            for (int g = 0; g < G; ++g)
                for (int i = 0; i < NV; ++i) acc[g][i] += s[g][t] * row[i];
        }
    }
    for (int g = 0; g < G; ++g) {
        const float inv = 1.0f / l[g];
        for (int i = 0; i < NV; ++i) store(out + g * D + i * 16, acc[g][i] * inv);
    }
}

template <typename T>
int decode(const T* q, const T* k, const T* v, const int64_t* block_table,
           const int64_t* ctx_lens, T* out, int batch, int heads, int kv_heads, int dim,
           int width, int page_size, int64_t head_stride, float scale) {
    if (kv_heads <= 0 || heads != kv_heads * GROUP || dim != HEAD_DIM || page_size <= 0 ||
        page_size > MAX_PAGE)
        return 1;
#pragma omp parallel for schedule(dynamic, 1)
    for (int item = 0; item < batch * kv_heads; ++item) {
        const int b = item / kv_heads, h = item % kv_heads;
        const int64_t at = (int64_t(b) * heads + int64_t(h) * GROUP) * dim;
        attend_one<T, GROUP, HEAD_DIM / 16>(q + at, k + h * head_stride, v + h * head_stride,
                                            block_table + int64_t(b) * width, ctx_lens[b],
                                            out + at, page_size, scale);
    }
    return 0;
}

}  // namespace

// dtype: 0 float32, 1 bfloat16. Returns 0, or 1 for a shape the library was not built for
// (or pages over 256 tokens).
extern "C" int pypto_paged_decode(int dtype, const void* q, const void* k, const void* v,
                                  const int64_t* block_table, const int64_t* ctx_lens, void* out,
                                  int batch, int heads, int kv_heads, int dim, int width,
                                  int page_size, int64_t head_stride, float scale) {
    if (dtype == 0)
        return decode(static_cast<const float*>(q), static_cast<const float*>(k),
                      static_cast<const float*>(v), block_table, ctx_lens,
                      static_cast<float*>(out), batch, heads, kv_heads, dim, width, page_size,
                      head_stride, scale);
    if (dtype == 1)
        return decode(static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k),
                      static_cast<const uint16_t*>(v), block_table, ctx_lens,
                      static_cast<uint16_t*>(out), batch, heads, kv_heads, dim, width,
                      page_size, head_stride, scale);
    return 1;
}
