// DeepSeek-V4's compressed attention (kv/kinds/compressed.py), reading the kind's pages in
// place: each query (of a decode or of a prefill chunk: its sequence and its position given)
// attends over the raw rows of its window and, in a compressed layer, the entries of the
// windows complete by its position (all of them: HCA; CSA: the top k the lightning indexer
// scores highest), with a per-head sink logit in the softmax's denominator. The same
// arithmetic as the kind's PyTorch path (float32 inside, scale head_dim^-0.5); no shape
// constant: one library for every model.
//
// Layouts (the kind's `Layout`):
//   rows      [slots, row_width] (float32 or bfloat16): a token's raw row of this layer at
//             column `row_offset`, its slot block_table[b][pos / page] * page + pos % page
//   entries   [pages, page_width * page] read as one flat block a page: window w's entry is
//             in the page of its last token, page p = ((w + 1) * ratio - 1) / page (the
//             sequence's entry_table[b][p]), at w - p * page / ratio; the entries of a layer
//             from column `entry_offset` (head_dim wide each), the indexer's keys from
//             `index_offset` (index_dim wide each)
//
// Work is done a block at a time: a run of up to BLOCK queries of one sequence at
// consecutive positions (a prefill chunk's; a decode is a block of one). A block reads the
// band of raw rows its windows cover once, widened to float32 and also stored transposed,
// and the entries (HCA) or the indexer's keys (CSA) once; each query then scores its own
// window's part of the band and its entries with loops over keys (unit stride, no
// horizontal sums: they vectorize at any -march) and sums the values the same way. Blocks
// spread over torch's OpenMP team. The windows a step completes are pooled into the entry
// pages before the call (on PyTorch).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int BLOCK = 64;  // queries of one sequence that share one read of their band

inline float widen(uint16_t h) {  // bfloat16 -> float32: its bits are the high half
    const uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

// n values of a cache row of `dtype` (0: float32, 1: bfloat16) from element `at`, as float32.
inline void read_row(const void* base, int dtype, int64_t at, int n, float* out) {
    if (dtype == 0) {
        std::memcpy(out, static_cast<const float*>(base) + at, sizeof(float) * n);
    } else {
        const uint16_t* p = static_cast<const uint16_t*>(base) + at;
        for (int i = 0; i < n; ++i) out[i] = widen(p[i]);
    }
}

// rows [n][dim] -> out [dim][n]
inline void transpose(const float* rows, int64_t n, int dim, float* out) {
    for (int64_t j = 0; j < n; ++j)
        for (int d = 0; d < dim; ++d) out[d * n + j] = rows[j * dim + d];
}

// out[i] += sum over r < rows of c[r] * base[r * stride + i], i < n: four rows a pass over
// out (unit stride, no horizontal sums). Scores are rows of the transposed keys weighted by
// the query; a weighted sum of values is rows of values weighted by the probabilities.
inline void add_rows(const float* c, int64_t rows, const float* base, int64_t stride,
                     int64_t n, float* __restrict out) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
        const float c0 = c[r], c1 = c[r + 1], c2 = c[r + 2], c3 = c[r + 3];
        const float* __restrict x0 = base + r * stride;
        const float* __restrict x1 = x0 + stride;
        const float* __restrict x2 = x1 + stride;
        const float* __restrict x3 = x2 + stride;
        for (int64_t i = 0; i < n; ++i) out[i] += c0 * x0[i] + c1 * x1[i] + c2 * x2[i] + c3 * x3[i];
    }
    for (; r < rows; ++r) {
        const float cr = c[r];
        const float* __restrict x = base + r * stride;
        for (int64_t i = 0; i < n; ++i) out[i] += cr * x[i];
    }
}

// out[j] = sum over d of q[d] * keys_t[d][first + j], j < n (keys_t: `stride` columns).
inline void scores_of(const float* q, const float* keys_t, int64_t stride, int64_t first,
                      int64_t n, int dim, float* __restrict out) {
    std::fill(out, out + n, 0.0f);
    add_rows(q, dim, keys_t + first, stride, n, out);
}

// out[d] += sum over j < n of p[j] * values[j][d].
inline void add_values(const float* p, const float* values, int64_t n, int dim, float* out) {
    add_rows(p, n, values, dim, dim, out);
}

// e^x for x <= 0 (softmax after subtracting the max): 2^n * e^r with |r| <= ln2 / 2 and a
// degree-6 Taylor polynomial for e^r (relative error < 2e-7); below -87 it flushes to ~0.
// Branch-free, so that a loop of it vectorizes.
inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const int32_t n = int32_t(x * 1.44269504f - 0.5f);  // round(x / ln2), x <= 0
    const float r = x - float(n) * 0.693147181f;
    const float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 +
                                            r * (1.0f / 120 + r * (1.0f / 720))))));
    const int32_t bits = (n + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

// p[j] = softmax over the n logits and the sink (whose own share is left out), in place.
inline void softmax_with_sink(float* __restrict p, int64_t n, float sink) {
    float top = sink;
#pragma omp simd reduction(max : top)
    for (int64_t j = 0; j < n; ++j) top = std::max(top, p[j]);
    float denom = exp_nonpositive(sink - top);
#pragma omp simd reduction(+ : denom)
    for (int64_t j = 0; j < n; ++j) {
        p[j] = exp_nonpositive(p[j] - top);
        denom += p[j];
    }
    const float inv = 1.0f / denom;
    for (int64_t j = 0; j < n; ++j) p[j] *= inv;
}

struct Entries {
    int ratio, page;
    const void* base;
    int64_t page_elems;  // elements of one page's flat block
    const int64_t* table;
    int64_t table_width;

    // Element index of window w's slot (its entry at `offset` + slot * width) for sequence b.
    int64_t at(int64_t b, int64_t w, int64_t offset, int width) const {
        const int64_t p = ((w + 1) * ratio - 1) / page;
        const int64_t slot = w - p * page / ratio;
        return table[b * table_width + p] * page_elems + offset + slot * width;
    }
};

// What one thread reuses from block to block.
struct Scratch {
    std::vector<float> band, band_t;        // the block's raw rows, [n][dim] and [dim][n]
    std::vector<float> ent, ent_t;          // entries: all (HCA) or a query's chosen (CSA)
    std::vector<float> index_t, score, tmp; // CSA: the indexer's keys [index_dim][n], scores
    std::vector<float> logits, qs;          // a head's logits, its query scaled
    std::vector<int64_t> chosen;
};

}  // namespace

extern "C" int pypto_compressed_attention(
    int dtype,                  // the caches': 0 float32, 1 bfloat16
    int queries, int heads, int dim,
    const float* q,             // [queries, heads, dim]
    const float* sinks,         // [heads]
    const int64_t* seqs,        // [queries]: each query's sequence (its row of the tables)
    const int64_t* positions,   // [queries]: each query's position in its sequence
    int window,
    const void* rows, int64_t row_width, int64_t row_offset,
    const int64_t* block_table, int64_t table_width, int page,
    int ratio,                  // 0: a window-only layer
    const void* entries, int64_t page_width, int64_t entry_offset,
    const int64_t* entry_table, int64_t entry_table_width,
    int index_heads,            // 0: no indexer (HCA: every entry)
    int index_dim, const float* index_q,  // [queries, index_heads, index_dim]
    const float* index_weights,           // [queries, index_heads]
    int64_t index_offset, int topk,
    float* out)                 // [queries, heads, dim]
{
    if (queries <= 0 || heads <= 0 || dim <= 0 || page <= 0 || window <= 0) return 1;
    if (ratio < 0 || (index_heads > 0 && (ratio == 0 || index_dim <= 0 || topk <= 0))) return 2;
    const Entries ent{ratio, page, entries, page_width * page, entry_table, entry_table_width};
    const float scale = 1.0f / std::sqrt(float(dim));
    std::vector<int> starts;  // the blocks: runs of one sequence at consecutive positions
    for (int i = 0; i < queries; ++i) {
        const bool same = i > 0 && seqs[i] == seqs[i - 1] && positions[i] == positions[i - 1] + 1
                          && i - starts.back() < BLOCK;
        if (!same) starts.push_back(i);
    }
    starts.push_back(queries);
    const int blocks = int(starts.size()) - 1;
#pragma omp parallel
    {
        Scratch s;
#pragma omp for schedule(dynamic, 1)
        for (int k = 0; k < blocks; ++k) {
            const int first = starts[k], last = starts[k + 1] - 1;
            const int64_t b = seqs[first];
            const int64_t lo = std::max<int64_t>(positions[first] - window + 1, 0);
            const int64_t n_band = positions[last] - lo + 1;
            s.band.resize(n_band * dim);
            s.band_t.resize(n_band * dim);
            for (int64_t j = 0; j < n_band; ++j) {
                const int64_t t = lo + j;
                const int64_t slot = block_table[b * table_width + t / page] * page + t % page;
                read_row(rows, dtype, slot * row_width + row_offset, dim, &s.band[j * dim]);
            }
            transpose(s.band.data(), n_band, dim, s.band_t.data());
            const int64_t n_all = ratio > 0 ? (positions[last] + 1) / ratio : 0;
            if (n_all > 0 && index_heads == 0) {  // HCA: every entry, read once a block
                s.ent.resize(n_all * dim);
                s.ent_t.resize(n_all * dim);
                for (int64_t w = 0; w < n_all; ++w)
                    read_row(entries, dtype, ent.at(b, w, entry_offset, dim), dim,
                             &s.ent[w * dim]);
                transpose(s.ent.data(), n_all, dim, s.ent_t.data());
            } else if (n_all > topk) {  // CSA with a choice to make: the indexer's keys
                s.index_t.resize(n_all * index_dim);
                s.tmp.resize(n_all * index_dim);
                for (int64_t w = 0; w < n_all; ++w)
                    read_row(entries, dtype, ent.at(b, w, index_offset, index_dim), index_dim,
                             &s.tmp[w * index_dim]);
                transpose(s.tmp.data(), n_all, index_dim, s.index_t.data());
            }
            for (int i = first; i <= last; ++i) {
                const int64_t pos = positions[i];
                const int64_t j0 = std::max<int64_t>(pos - window + 1, 0) - lo;
                const int64_t n_rows = pos - lo + 1 - j0;
                const int64_t n_seen = ratio > 0 ? (pos + 1) / ratio : 0;
                // the entries it reads: ent_t's first n_ent columns (and ent's rows)
                int64_t n_ent = n_seen, ent_stride = n_all;
                if (index_heads > 0) {
                    s.chosen.resize(n_seen);
                    for (int64_t w = 0; w < n_seen; ++w) s.chosen[w] = w;
                    if (n_seen > topk) {
                        s.score.assign(n_seen, 0.0f);
                        s.tmp.resize(n_seen);
                        const float* iq = index_q + int64_t(i) * index_heads * index_dim;
                        const float* iw = index_weights + int64_t(i) * index_heads;
                        for (int h = 0; h < index_heads; ++h) {
                            scores_of(iq + int64_t(h) * index_dim, s.index_t.data(), n_all, 0,
                                      n_seen, index_dim, s.tmp.data());
                            for (int64_t w = 0; w < n_seen; ++w)
                                s.score[w] += iw[h] * std::max(s.tmp[w], 0.0f);
                        }
                        const float* sc = s.score.data();
                        std::partial_sort(s.chosen.begin(), s.chosen.begin() + topk,
                                          s.chosen.end(), [sc](int64_t x, int64_t y) {
                                              return sc[x] > sc[y] || (sc[x] == sc[y] && x < y);
                                          });
                        s.chosen.resize(topk);
                    }
                    n_ent = ent_stride = int64_t(s.chosen.size());
                    s.ent.resize(n_ent * dim);
                    s.ent_t.resize(n_ent * dim);
                    for (int64_t c = 0; c < n_ent; ++c)
                        read_row(entries, dtype, ent.at(b, s.chosen[c], entry_offset, dim), dim,
                                 &s.ent[c * dim]);
                    transpose(s.ent.data(), n_ent, dim, s.ent_t.data());
                }
                s.logits.resize(n_rows + n_ent);
                float* lg = s.logits.data();
                s.qs.resize(dim);
                float* qs = s.qs.data();
                for (int h = 0; h < heads; ++h) {
                    const float* qh = q + (int64_t(i) * heads + h) * dim;
                    for (int d = 0; d < dim; ++d) qs[d] = qh[d] * scale;
                    scores_of(qs, s.band_t.data(), n_band, j0, n_rows, dim, lg);
                    if (n_ent > 0)
                        scores_of(qs, s.ent_t.data(), ent_stride, 0, n_ent, dim,
                                  lg + n_rows);
                    softmax_with_sink(lg, n_rows + n_ent, sinks[h]);
                    float* oh = out + (int64_t(i) * heads + h) * dim;
                    std::fill(oh, oh + dim, 0.0f);
                    add_values(lg, &s.band[j0 * dim], n_rows, dim, oh);
                    if (n_ent > 0) add_values(lg + n_rows, s.ent.data(), n_ent, dim, oh);
                }
            }
        }
    }
    return 0;
}
