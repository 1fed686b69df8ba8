// DeepSeek-V4's compressed attention (kv/kinds/compressed.py), reading the kind's pages in
// place: each query (of a decode or of a prefill chunk: its sequence and its position given)
// attends over the raw rows of its window and, in a compressed layer, the entries of the
// windows complete by its position (all of them: HCA; CSA: the top k the lightning indexer
// scores highest), with a per-head sink logit in the softmax's denominator. The same arithmetic as the kind's PyTorch path (float32 inside,
// scale head_dim^-0.5); no shape constant: one library for every model.
//
// Layouts (the kind's `Layout`):
//   rows      [slots, row_width] (float32 or bfloat16): a token's raw row of this layer at
//             column `row_offset`, its slot block_table[b][pos / page] * page + pos % page
//   entries   [pages, page_width * page] read as one flat block a page: window w's entry is
//             in the page of its last token, page p = ((w + 1) * ratio - 1) / page (the
//             sequence's entry_table[b][p]), at w - p * page / ratio; the entries of a layer
//             from column `entry_offset` (head_dim wide each), the indexer's keys from
//             `index_offset` (index_dim wide each)
// A query's work runs on one thread of torch's OpenMP team; queries spread over it. The
// windows a step completes are pooled into the entry pages before the call (on PyTorch).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

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

inline float dot(const float* a, const float* b, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
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
#pragma omp parallel for schedule(dynamic, 1)
    for (int i = 0; i < queries; ++i) {
        const int64_t b = seqs[i], pos = positions[i];
        const int64_t lo = std::max<int64_t>(pos - window + 1, 0);
        const int64_t n_entries = ratio > 0 ? (pos + 1) / ratio : 0;
        std::vector<int64_t> chosen;  // the windows whose entries it reads
        if (index_heads > 0 && n_entries > topk) {
            std::vector<float> score(n_entries), key(index_dim);
            const float* iq = index_q + int64_t(i) * index_heads * index_dim;
            const float* iw = index_weights + int64_t(i) * index_heads;
            for (int64_t w = 0; w < n_entries; ++w) {
                read_row(entries, dtype, ent.at(b, w, index_offset, index_dim), index_dim,
                         key.data());
                float s = 0.0f;
                for (int h = 0; h < index_heads; ++h)
                    s += iw[h] * std::max(dot(iq + int64_t(h) * index_dim, key.data(), index_dim),
                                          0.0f);
                score[w] = s;
            }
            chosen.resize(n_entries);
            for (int64_t w = 0; w < n_entries; ++w) chosen[w] = w;
            std::partial_sort(chosen.begin(), chosen.begin() + topk, chosen.end(),
                              [&](int64_t x, int64_t y) {
                                  return score[x] > score[y] || (score[x] == score[y] && x < y);
                              });
            chosen.resize(topk);
        } else {
            for (int64_t w = 0; w < n_entries; ++w) chosen.push_back(w);
        }
        // the keys (= values): the window's raw rows, then the chosen entries
        const int64_t n_rows = pos - lo + 1, n_keys = n_rows + int64_t(chosen.size());
        std::vector<float> keys(n_keys * dim), scores(n_keys);
        for (int64_t j = 0; j < n_rows; ++j) {
            const int64_t t = lo + j;
            const int64_t slot = block_table[b * table_width + t / page] * page + t % page;
            read_row(rows, dtype, slot * row_width + row_offset, dim, &keys[j * dim]);
        }
        for (size_t i = 0; i < chosen.size(); ++i)
            read_row(entries, dtype, ent.at(b, chosen[i], entry_offset, dim),
                     dim, &keys[(n_rows + int64_t(i)) * dim]);
        for (int h = 0; h < heads; ++h) {
            const float* qh = q + (int64_t(i) * heads + h) * dim;
            float top = sinks[h];
            for (int64_t s = 0; s < n_keys; ++s) {
                scores[s] = dot(qh, &keys[s * dim], dim) * scale;
                top = std::max(top, scores[s]);
            }
            float denom = std::exp(sinks[h] - top);
            for (int64_t s = 0; s < n_keys; ++s) {
                scores[s] = std::exp(scores[s] - top);
                denom += scores[s];
            }
            float* oh = out + (int64_t(i) * heads + h) * dim;
            std::fill(oh, oh + dim, 0.0f);
            for (int64_t s = 0; s < n_keys; ++s) {
                const float p = scores[s] / denom;
                const float* k = &keys[s * dim];
                for (int d = 0; d < dim; ++d) oh[d] += p * k[d];
            }
        }
    }
    return 0;
}
