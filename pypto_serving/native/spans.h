// How a step's decodes split their contexts into spans, for attention.cpp's batch kernel and
// decode.cpp's fused step alike (both attend a step through the same plan, so a decode's
// result is the same bits whichever path takes it).
//
// A long context is split into spans of whole pages, each span's softmax state (its max, sum
// and weighted values) a work item of its own, then merged in span order: a single stream
// (or a few) keeps every thread of a big team busy, not one per KV head. The split depends
// on the context's length alone, so a decode's result is the same bits whatever its company
// in the batch; a context of one span is the unsplit computation exactly (its merge
// multiplies by e^0 = 1). SmolLM2 on 2 cores, one sequence at 8,000 tokens: 8 spans took the
// attention from 15.3 to 12.1 ms a step (pages scattered), the whole native step
// 0.87-0.93x; at 2,000 tokens 0.93x. Spans of 512 tokens cost batches of long contexts more.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace spans {

constexpr int SPAN_TOKENS = 1024;  // a span's tokens, about (whole pages)
constexpr int MAX_SPANS = 8;       // spans of a context at most

// Spans are work items of their own only where the (sequence, KV head) pairs as items would
// leave a tenth of the team idle or more (3 pairs on 2 threads: a quarter); else a pair's
// spans are one item, the same arithmetic. SmolLM2's native step (3 KV heads) on 2 threads,
// against unsplit: 2 sequences of 4,000 tokens 1.107x the time with each span an item, 0.956x
// with a pair's spans one item; 16 of 2,000 tokens, one item each, 1.02x.
inline bool few_items(int pairs, int threads) {
    const int rounds = (pairs + threads - 1) / threads;  // items the busiest thread takes
    return 10 * pairs < 9 * rounds * threads;
}

// A step's spans: row m's are first[m] .. first[m + 1] - 1 of the step's, each covering
// each[m] of its pages[m] pages (the last fewer); their states lie [row][KV head][span], of
// `floats` each. split: spans are work items of their own, where some row has several and
// the (row, KV head) pairs are too few to keep the team busy.
struct Plan {
    std::vector<int> first, each, pages;
    bool split = false;
    int kv_heads = 0;
    size_t floats = 0;

    void plan(const int64_t* ctx_lens, int rows, int heads, int page_size, int threads,
              size_t part_floats) {
        first.assign(rows + 1, 0);
        each.resize(rows);
        pages.resize(rows);
        for (int m = 0; m < rows; ++m) {
            const int64_t n = std::max<int64_t>(1, (ctx_lens[m] + page_size - 1) / page_size);
            const int64_t want = std::clamp<int64_t>(
                (ctx_lens[m] + SPAN_TOKENS - 1) / SPAN_TOKENS, 1, MAX_SPANS);
            each[m] = int((n + want - 1) / want);
            pages[m] = int(n);
            first[m + 1] = first[m] + int((n + each[m] - 1) / each[m]);
        }
        split = first[rows] > rows && few_items(rows * heads, threads);
        kv_heads = heads;
        floats = part_floats;
    }
    int spans(int m) const { return first[m + 1] - first[m]; }
    int total() const { return first.back(); }
    int row_of(int j) const {  // the row whose span the step's span j is
        return int(std::upper_bound(first.begin(), first.end(), j) - first.begin()) - 1;
    }
    // row m's span j (its own index: 0 .. spans(m) - 1) covers pages [from, end) of its table
    int from(int m, int j) const { return j * each[m]; }
    int end(int m, int j) const { return std::min((j + 1) * each[m], pages[m]); }
    // where row m's states for KV head kvh begin (its spans' follow each other)
    size_t state(int m, int kvh) const {
        return (size_t(first[m]) * kv_heads + size_t(kvh) * spans(m)) * floats;
    }
    size_t state_floats() const { return size_t(total()) * kv_heads * floats; }
};

}  // namespace spans
