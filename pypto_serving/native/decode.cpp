// The fused decode step for the CPU: the whole forward of a step of decodes (one new token
// per row, up to MAX_ROWS rows; the executor sends a few, or every step's where a model's
// records are its only weights; rows of one sequence are speculative decoding's guesses,
// each at its position) in one call, the way llama.cpp runs a token:
// the embedding, every decoder layer (RMSNorm, q/k/v, q/k norm, RoPE, the KV write, paged
// attention, the output projection, RMSNorm, SwiGLU) and the final norm and LM head.
//
// The matmuls are records.h's (weights in 4-bit or 8-bit records, or plain bf16 rows).
//
// Everything else is float32: the residual stream, norms, RoPE and the attention's queries;
// keys and values go into the bfloat16 or int8 KV cache through attention.cpp. The work is
// shared by one OpenMP team for the whole step: matmuls split their 16-row blocks, attention
// its (sequence, KV head) pairs, and the norms, SwiGLU and the activations' quantization
// their rows.
//
// Under tensor parallelism (ranks on one machine) each rank runs its share: its vocabulary
// rows of the embedding, its heads, its MLP columns and its LM head rows; the partial sums
// of the embedding, o_proj and down_proj are all-reduced and the logits all-gathered through
// the shared-memory collectives (native/shm.cpp, reached through the Model's function
// pointers), each called by one thread of the team.
#include "records.h"
#include "spans.h"

extern "C" void pypto_store_kv_head(int kv_int8, const float* k, const float* v, void* k_cache,
                                    void* v_cache, int64_t slot);
extern "C" int pypto_decode_part_floats();
extern "C" void pypto_decode_attention_span(int kv_int8, const float* q, const void* k,
                                            const void* v, const int64_t* pages, int64_t ctx,
                                            int first_page, int end_page, int page_size,
                                            float scale, float* part);
extern "C" void pypto_decode_attention_merge(int kv_int8, const float* parts, int spans,
                                             float* out);

namespace {

constexpr int MAX_ROWS = 256;  // sequences in a step

// shm.cpp's pypto_shm_all_reduce and pypto_shm_all_gather.
using AllReduce = int (*)(void*, const float*, float*, int64_t, double, int*);
using AllGather = int (*)(void*, const void*, void*, int64_t, int64_t, double, int*);

struct Layer {
    const uint16_t *input_norm, *post_norm;  // bfloat16 [hidden]
    const uint16_t *q_norm, *k_norm;         // bfloat16 [head_dim], or null
    Matrix qkv, o, gate_up, down;
    void *k_cache, *v_cache;                 // this layer's [kv_heads, slots, row]
};

struct Model {
    int32_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, kv_int8;
    int32_t page_size;
    float eps, rope_scaling;
    int64_t head_stride;           // cache elements from one KV head to the next
    const float* inv_freq;         // [head_dim / 2]
    const uint16_t* embed;         // bfloat16 [vocab, hidden]; null: lm_head's Q8 rows
    const uint16_t* final_norm;    // bfloat16 [hidden]
    Matrix lm_head;
    const Layer* layers;
    int32_t world;                 // tensor-parallel ranks (1: none)
    int64_t vocab_start, embed_rows;  // this rank's rows of the embedding
    void* comm;                    // the shared-memory group, under TP
    AllReduce all_reduce;
    AllGather all_gather;
};

struct Step {
    int32_t rows, width, threads;
    const int64_t *tokens, *positions, *slots, *block_table, *ctx_lens;  // block_table [rows, width]
    float* logits;                 // [rows, vocab] (under TP: [rows, world * vocab], gathered)
    double timeout_s;              // how long a collective waits for the other ranks
    int32_t* who;                  // the rank a failed collective waited for
};

// out = RMSNorm(x) * weight, per row of `size` values.
void rms_norm(const float* x, const uint16_t* weight, int size, float eps, float* out) {
    float ss = 0.0f;
    for (int i = 0; i < size; ++i) ss += x[i] * x[i];
    const float inv = 1.0f / std::sqrt(ss / float(size) + eps);
    for (int i = 0; i < size; ++i) out[i] = x[i] * inv * bf16(weight[i]);
}

// Rotate one head's half-split ("NeoX") pairs by the row's angles.
void rope(float* x, const float* cos, const float* sin, int half) {
    for (int i = 0; i < half; ++i) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i] + a * sin[i];
    }
}

struct Scratch {
    std::vector<float> x, h, qkv, attn, gate_up, cos, sin, part, sum;
    Activations qx, qa, qm;  // the rows as the matmuls read them: normed, attention's, MLP's
    int status = 0;                // the first failed collective's
    bool shared = false;           // rows of one sequence: all keys written before any attends
    // The step's spans and their softmax states (attention.cpp's part floats each, laid out
    // as spans.h's plan says); attention.cpp's batch kernel attends a step by the same plan.
    spans::Plan spans;
    std::vector<float> states;
};

// Under TP: the sum over the ranks of every rank's partial `w.part` [rows, hidden], added
// to the residual stream (one thread). A failed collective leaves its status; the group is
// then broken, so the later ones return at once and the step ends with it.
void reduce_into_x(const Model& md, const Step& s, int rows, Scratch& w) {
    const int64_t n = int64_t(rows) * md.hidden;
    const int status = md.all_reduce(md.comm, w.part.data(), w.sum.data(), n, s.timeout_s, s.who);
    if (status && !w.status) w.status = status;
    for (int64_t i = 0; i < n; ++i) w.x[i] += w.sum[i];
}

// out (=|+=) the row-parallel `m` over qx: straight into the residual stream on one rank,
// else each rank's partial product summed over the ranks first.
void row_parallel(const Model& md, const Step& s, const Matrix& m, const Activations& qx,
                  Scratch& w) {
    if (md.world == 1) {
        product(m, qx, s.rows, w.x.data(), md.hidden, true);
        return;
    }
    product(m, qx, s.rows, w.part.data(), md.hidden, false);
#pragma omp single
    reduce_into_x(md, s, s.rows, w);
}

// qx = the rows of the residual stream x, RMS-normed by `weight` (into h), as a matmul over
// weights of `format` reads them (the rows shared by the team; qx sized for them).
void norm_rows(const Model& md, const uint16_t* weight, int rows, int format, Scratch& w) {
#pragma omp for schedule(static)
    for (int m = 0; m < rows; ++m) {
        rms_norm(&w.x[m * md.hidden], weight, md.hidden, md.eps, &w.h[m * md.hidden]);
        quantize_row(w.h.data(), m, format, w.qx);
    }
}

// e^x in float32, written so that a loop over many x vectorizes (no call): 2^n e^r with
// n = round(x / ln 2) (the 1.5 * 2^23 shift rounds to nearest even), |r| <= ln 2 / 2, and a
// degree-6 Taylor polynomial for e^r (relative error < 2e-7, as attention.cpp's vexp); x is
// clamped to [-87, 88], where e^x is 1.6e-38 and 1.7e38: SwiGLU's gate is then 0 or its input.
// Built as `swiglu` is (a function with other options would not be inlined into it).
__attribute__((optimize("no-trapping-math"))) inline float exp_lanes(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
    const float r = x - n * 0.693147181f;
    const float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 +
                                                 r * (1.0f / 120 + r * (1.0f / 720))))));
    const int32_t bits = (int32_t(n) + 127) * 8388608;  // 2^n
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

// SwiGLU of one row: a[i] = silu(gu[i]) * gu[inter + i], the gate's e^-x by `exp_lanes`,
// vectorized (libm's expf, a call a value, took ~6 % of a step of 8 or 64 rows). Built not
// to keep FP exceptions exact (none is read), so that AVX2's compiler may turn the clamps
// into blends (AVX-512 masks them anyway).
__attribute__((optimize("no-trapping-math"))) void swiglu(const float* gu, float* a, int inter) {
    for (int i = 0; i < inter; ++i) a[i] = gu[i] / (1.0f + exp_lanes(-gu[i])) * gu[inter + i];
}

// qx = rows of `x` as a matmul over weights of `format` reads them (the rows shared by the
// team; qx sized for them and their width).
void quantize_rows(const float* x, int rows, int format, Activations& qx) {
#pragma omp for schedule(static)
    for (int m = 0; m < rows; ++m) quantize_row(x, m, format, qx);
}

// One KV head's share of a layer's cache (k_cache or v_cache).
char* head_cache(const Model& md, void* cache, int kvh) {
    return static_cast<char*>(cache) + kvh * md.head_stride * (md.kv_int8 ? 1 : 2);
}

// Row m's span j (0 .. its spans - 1) for KV head kvh: its queries (normed and roped in w.qkv)
// over that span's pages, the state into w.states.
void attend_span(const Model& md, const Layer& ly, const Step& s, int m, int j, int kvh,
                 Scratch& w) {
    const int dim = md.head_dim, group = md.heads / md.kv_heads;
    const int64_t qkv_size = int64_t(md.heads + 2 * md.kv_heads) * dim;
    const spans::Plan& p = w.spans;
    pypto_decode_attention_span(md.kv_int8, &w.qkv[m * qkv_size + kvh * group * dim],
                                head_cache(md, ly.k_cache, kvh), head_cache(md, ly.v_cache, kvh),
                                s.block_table + int64_t(m) * s.width, s.ctx_lens[m], p.from(m, j),
                                p.end(m, j), md.page_size, 1.0f / std::sqrt(float(dim)),
                                &w.states[p.state(m, kvh) + j * p.floats]);
}

// Row m's attention output for KV head kvh's query heads: its spans' states merged.
void merge_head(const Model& md, int m, int kvh, Scratch& w) {
    const int dim = md.head_dim, group = md.heads / md.kv_heads;
    pypto_decode_attention_merge(md.kv_int8, &w.states[w.spans.state(m, kvh)],
                                 w.spans.spans(m),
                                 &w.attn[(int64_t(m) * md.heads + kvh * group) * dim]);
}

// One decoder layer over s.rows rows of the residual stream x (called by every thread).
void layer(const Model& md, const Layer& ly, const Step& s, Scratch& w) {
    const int rows = s.rows, dim = md.head_dim, half = dim / 2;
    const int group = md.heads / md.kv_heads, inter = md.intermediate;
    const int q_size = md.heads * dim, kv_size = md.kv_heads * dim;
    const int qkv_size = q_size + 2 * kv_size;
    norm_rows(md, ly.input_norm, rows, ly.qkv.format, w);
    product(ly.qkv, w.qx, rows, w.qkv.data(), qkv_size, false);
#pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < rows * md.kv_heads; ++item) {
        const int m = item / md.kv_heads, kvh = item % md.kv_heads;
        float* row = &w.qkv[int64_t(m) * qkv_size];
        const float *cos = &w.cos[m * half], *sin = &w.sin[m * half];
        float* q = row + kvh * group * dim;
        float* k = row + q_size + kvh * dim;
        const float* v = row + q_size + kv_size + kvh * dim;
        for (int h = 0; h < group; ++h) {
            if (ly.q_norm) rms_norm(q + h * dim, ly.q_norm, dim, md.eps, q + h * dim);
            rope(q + h * dim, cos, sin, half);
        }
        if (ly.k_norm) rms_norm(k, ly.k_norm, dim, md.eps, k);
        rope(k, cos, sin, half);
        pypto_store_kv_head(md.kv_int8, k, v, head_cache(md, ly.k_cache, kvh),
                            head_cache(md, ly.v_cache, kvh), s.slots[m]);
        if (!w.shared && !w.spans.split) {  // its own row's key written: attend now
            for (int j = 0; j < w.spans.spans(m); ++j) attend_span(md, ly, s, m, j, kvh, w);
            merge_head(md, m, kvh, w);
        }
    }
    if (w.shared || w.spans.split) {  // every row's key and value is written (the loop's barrier)
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < w.spans.total() * md.kv_heads; ++item) {
            const int m = w.spans.row_of(item / md.kv_heads);
            const int j = item / md.kv_heads - w.spans.first[m];
            attend_span(md, ly, s, m, j, item % md.kv_heads, w);
        }
#pragma omp for schedule(static)
        for (int item = 0; item < rows * md.kv_heads; ++item)
            merge_head(md, item / md.kv_heads, item % md.kv_heads, w);
    }
    quantize_rows(w.attn.data(), rows, ly.o.format, w.qa);
    row_parallel(md, s, ly.o, w.qa, w);
    norm_rows(md, ly.post_norm, rows, ly.gate_up.format, w);
    product(ly.gate_up, w.qx, rows, w.gate_up.data(), 2 * inter, false);
#pragma omp for schedule(static)
    for (int m = 0; m < rows; ++m) {  // SwiGLU: silu(gate) * up
        const float* gu = &w.gate_up[int64_t(m) * 2 * inter];
        float* a = &w.h[int64_t(m) * inter];
        swiglu(gu, a, inter);
        quantize_row(w.h.data(), m, ly.down.format, w.qm);
    }
    row_parallel(md, s, ly.down, w.qm, w);
}

}  // namespace

extern "C" int pypto_native_max_rows() { return MAX_ROWS; }
extern "C" int pypto_native_wide_rows() { return WIDE_ROWS; }  // this build's widest last block

// The LM head's logits of the final-normed rows: this rank's vocabulary rows, gathered over
// the ranks under TP (into s.logits, [rows, world, vocab]).
static void lm_head(const Model& md, const Step& s, Scratch& w) {
    if (md.world == 1) {
        product(md.lm_head, w.qx, s.rows, s.logits, md.vocab, false);
        return;
    }
    product(md.lm_head, w.qx, s.rows, w.part.data(), md.vocab, false);
#pragma omp single
    {
        const int status = md.all_gather(md.comm, w.part.data(), s.logits, s.rows,
                                         int64_t(md.vocab) * 4, s.timeout_s, s.who);
        if (status && !w.status) w.status = status;
    }
}

// The forward of a step of s.rows decodes (1 to MAX_ROWS): logits [rows, vocab] of each
// sequence's new token, its key and value written into the KV cache. Returns 0, 1 for a
// step or model it does not take, or under TP 10 + a failed collective's status (shm.cpp's).
extern "C" int pypto_decode_step(const Model* model, const Step* step) {
    const Model& md = *model;
    const Step& s = *step;
    if (s.rows < 1 || s.rows > MAX_ROWS || md.hidden % GROUP_K || md.intermediate % GROUP_K ||
        (md.heads * md.head_dim) % GROUP_K || md.head_dim % 2)
        return 1;
    const int rows = s.rows, hidden = md.hidden, half = md.head_dim / 2;
    Scratch w;
    w.x.resize(size_t(rows) * hidden);
    w.h.resize(size_t(rows) * (hidden > md.intermediate ? hidden : md.intermediate));
    w.qkv.resize(size_t(rows) * (md.heads + 2 * md.kv_heads) * md.head_dim);
    w.attn.resize(size_t(rows) * md.heads * md.head_dim);
    w.gate_up.resize(size_t(rows) * 2 * md.intermediate);
    w.cos.resize(size_t(rows) * half);
    w.sin.resize(size_t(rows) * half);
    if (md.world > 1) {
        w.part.resize(size_t(rows) * (hidden > md.vocab ? hidden : md.vocab));
        w.sum.resize(size_t(rows) * hidden);
    }
    for (int m = 0; m < rows; ++m) {
        const int64_t token = s.tokens[m] - md.vocab_start;  // zeros unless this rank's row
        const bool here = token >= 0 && token < md.embed_rows;
        float* x = md.world > 1 ? &w.part[m * hidden] : &w.x[m * hidden];
        if (!here) {
            std::fill(x, x + hidden, 0.0f);
        } else if (md.embed == nullptr) {  // a tied embedding: the LM head's Q8 records
            q8_row(md.lm_head, token, x);
        } else {
            const uint16_t* e = md.embed + token * hidden;
            for (int i = 0; i < hidden; ++i) x[i] = bf16(e[i]);
        }
        for (int i = 0; i < half; ++i) {
            const float angle = float(s.positions[m]) * md.inv_freq[i];
            w.cos[m * half + i] = std::cos(angle) * md.rope_scaling;
            w.sin[m * half + i] = std::sin(angle) * md.rope_scaling;
        }
    }
    // Speculative decoding verifies a sequence's guesses as rows of one step, each at its
    // position: a row attends over the keys of the rows before it, written in this step.
    // Rows of one sequence share their first page (so may rows of a shared prefix: they
    // only take the same two passes).
    for (int m = 1; m < rows && !w.shared; ++m)
        for (int j = 0; j < m && !w.shared; ++j)
            w.shared = s.block_table[int64_t(m) * s.width] == s.block_table[int64_t(j) * s.width];
    w.spans.plan(s.ctx_lens, rows, md.kv_heads, md.page_size, s.threads,
                 size_t(pypto_decode_part_floats()));
    w.states.resize(w.spans.state_floats());
    if (md.world > 1) reduce_into_x(md, s, rows, w);  // x is zero: the summed embedding
    w.qx.resize(rows, hidden);
    w.qa.resize(rows, md.heads * md.head_dim);
    w.qm.resize(rows, md.intermediate);
#pragma omp parallel num_threads(s.threads)
    {
        for (int l = 0; l < md.num_layers; ++l) layer(md, md.layers[l], s, w);
        norm_rows(md, md.final_norm, rows, md.lm_head.format, w);
        lm_head(md, s, w);
    }
    return w.status ? 10 + w.status : 0;
}
