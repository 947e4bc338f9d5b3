/* Every decoder layer of a one-token decode step in one call, for llama-shaped models with int4 layers:
   streamchat's own kernel.

   Built and loaded by streamchat/placement/native.py; called by streamchat/placement/lean_forward.py.

   Per layer, the lean step's operations (lean_forward.py) in its dtypes and roundings, so that logits
   and caches equal its own bit for bit (tests/placement/test_fused_decode.py): RMSNorm -> qkv
   (int4_rows) -> rotary on q and k, each product and their sum rounded to bfloat16 as torch rounds
   them -> k and v written into the cache's slot, the sinks rotated from their pristine float32 copies
   (SinkLayer.place_sinks) -> attention over the slots in use (decode_attention) -> o_proj, residual ->
   RMSNorm -> gate_up -> SiLU(gate) * up -> down, residual. Python runs about 1,400 small operators
   for the same work, half a decode step of the default model; here the step is the kernels alone.

   Rows are conversations, each at its own position over its own cache: one SinkCache (one row) or the
   rows of a pool (cache/batch.py), whose storage is one allocation per layer. table [layers, FIELDS]
   holds each layer's addresses (norms, weights, the storage of row 0); dims the sizes and strides;
   hidden [rows, hidden_size] is read and overwritten with the last layer's output; cos and sin
   [rows, head_dim] are each row's rotary angles (sin with its first half negated); slots [rows] where
   each row's token goes, sinks [rows] how many sinks each row has; sink_cos and sink_sin [rows,
   rotary_dim] (float32) each row's sink rotation; mask [rows, extent] float32 terms added to the scores,
   or none. In an int8 cache (--kv-cache int8) each key and value is quantized as it is written, and the
   sinks are turned into their exact bfloat16 copies (SINK_KEYS), which attention reads for a row's first
   slots. */
#include <float.h>
#include <math.h>
#include <stdlib.h>

#include "attention.h"
#include "bfloat16.h"
#include "kernels.h"
#include "vector_exp.h"
#include "vectors.h"

/* A projection's three fields: tile-packed nibbles, params, and a bfloat16 bias or 0. */
enum { NIBBLES, PARAMS, BIAS, PROJECTION_FIELDS };
enum {
    INPUT_NORM,
    POST_NORM,
    QKV,
    O_PROJ = QKV + PROJECTION_FIELDS,
    GATE_UP = O_PROJ + PROJECTION_FIELDS,
    DOWN = GATE_UP + PROJECTION_FIELDS,
    KEYS = DOWN + PROJECTION_FIELDS, /* bfloat16 [rows, kv_heads, slots, head_dim] at KEY_ROW, KEY_HEAD strides */
    VALUES,
    PRISTINE, /* float32 [rows, kv_heads, sinks, rotary_dim]: the sinks' keys unrotated, their rotate_half partners */
    PARTNERS,
    KEY_SCALES, /* an int8 cache's (KEYS, VALUES int8 levels): float32 [rows, kv_heads, slots], else 0 */
    VALUE_SCALES,
    SINK_KEYS, /* where the sinks' keys sit in bfloat16 at EXACT_ROW, EXACT_HEAD: an int8 cache's copies, else KEYS */
    SINK_VALUES,
    FIELDS
};
enum {
    HIDDEN_SIZE,
    Q_HEADS,
    KV_HEADS,
    HEAD_DIM,
    INTERMEDIATE,
    ROWS,
    KEY_ROW,
    KEY_HEAD,
    VALUE_ROW,
    VALUE_HEAD,
    SINK_ROW,
    SINK_HEAD,
    ROTARY_DIM,
    EXTENT,
    INT8_CACHE, /* 1: keys and values are stored as int8 levels and scales (cache/quantized_kv.py) */
    SCALE_ROW,
    SCALE_HEAD,
    EXACT_ROW,
    EXACT_HEAD
};

/* out [rows, n] = x [rows, k] @ W.T (+ bias), bfloat16, as PackedLinear.forward rounds it: the product,
   then the bias' sum. */
static int project(const int64_t *fields, const uint16_t *x, int64_t rows, int64_t k, int64_t n, uint16_t *out,
                   int threads) {
    int failed = int4_rows(x, 1, rows, k, (const uint8_t *)fields[NIBBLES], (const uint16_t *)fields[PARAMS], n, out,
                           1, threads);
    const uint16_t *bias = (const uint16_t *)fields[BIAS];
    if (bias)
        for (int64_t i = 0; i < rows * n; i++)
            out[i] = float_to_bf16(bf16_to_float(out[i]) + bf16_to_float(bias[i % n]));
    return failed;
}

/* head [head_dim] <- head * cos + roll(head, head_dim / 2) * signed sin, each step rounded to bfloat16. */
static void rotate(uint16_t *head, int64_t dim, const uint16_t *cos, const uint16_t *sin) {
    uint16_t rotated[512];
    int64_t half = dim / 2;
    for (int64_t i = 0; i < dim; i++) {
        uint16_t turned = float_to_bf16(bf16_to_float(head[i]) * bf16_to_float(cos[i]));
        uint16_t partner = float_to_bf16(bf16_to_float(head[(i + half) % dim]) * bf16_to_float(sin[i]));
        rotated[i] = float_to_bf16(bf16_to_float(turned) + bf16_to_float(partner));
    }
    memcpy(head, rotated, dim * sizeof *head);
}

/* x [dim] (bfloat16) as int8 levels and their scale, as cache/quantized_kv.py's quantize rounds them:
   scale = max |x| / 127, level = x / scale to nearest, ties to even. */
static void quantize(const uint16_t *x, int64_t dim, int8_t *levels, float *scale) {
    floats16 largest = zeros_16();
    for (int64_t d = 0; d < dim; d += 16) largest = max_16(largest, abs_16(load_16(x, 1, d)));
    const float step = largest_16(largest) / 127.0f;
    const floats16 divisor = splat_16(step > 0.0f ? step : FLT_MIN); /* an all-zero vector: levels 0 */
    for (int64_t d = 0; d < dim; d += 16) store_int8_16(levels + d, div_16(load_16(x, 1, d), divisor));
    *scale = step;
}

/* Each row's key and value into its slot, then each of its sinks' keys turned by its sink shift. */
static void write_cache(const int64_t *layer, const int64_t *dims, const uint16_t *qkv, const int64_t *slots,
                        const int64_t *sinks, const float *sink_cos, const float *sink_sin) {
    const int64_t dim = dims[HEAD_DIM], rotary = dims[ROTARY_DIM], kv_heads = dims[KV_HEADS];
    const int64_t q_size = dims[Q_HEADS] * dim, qkv_size = q_size + 2 * kv_heads * dim;
    for (int64_t r = 0; r < dims[ROWS]; r++) {
        const uint16_t *keys = qkv + r * qkv_size + q_size, *values = keys + kv_heads * dim;
        const float *cos = sink_cos + r * rotary, *sin = sink_sin + r * rotary;
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t key_at = r * dims[KEY_ROW] + h * dims[KEY_HEAD] + slots[r] * dim;
            const int64_t value_at = r * dims[VALUE_ROW] + h * dims[VALUE_HEAD] + slots[r] * dim;
            if (dims[INT8_CACHE]) {
                const int64_t scale_at = r * dims[SCALE_ROW] + h * dims[SCALE_HEAD] + slots[r];
                quantize(keys + h * dim, dim, (int8_t *)layer[KEYS] + key_at, (float *)layer[KEY_SCALES] + scale_at);
                quantize(values + h * dim, dim, (int8_t *)layer[VALUES] + value_at,
                         (float *)layer[VALUE_SCALES] + scale_at);
            } else {
                memcpy((uint16_t *)layer[KEYS] + key_at, keys + h * dim, dim * sizeof *keys);
                memcpy((uint16_t *)layer[VALUES] + value_at, values + h * dim, dim * sizeof *values);
            }
            uint16_t *row_keys = (uint16_t *)layer[SINK_KEYS] + r * dims[EXACT_ROW] + h * dims[EXACT_HEAD];
            int64_t at = r * dims[SINK_ROW] + h * dims[SINK_HEAD];
            const float *pristine = (const float *)layer[PRISTINE] + at;
            const float *partners = (const float *)layer[PARTNERS] + at;
            for (int64_t s = 0; s < sinks[r]; s++)
                for (int64_t d = 0; d < rotary; d++) {
                    /* torch.addcmul(pristine * cos, partners, sin): a product, then a fused multiply-add. */
                    float turned = pristine[s * rotary + d] * cos[d];
                    row_keys[s * dim + d] = float_to_bf16(fmaf(partners[s * rotary + d], sin[d], turned));
                }
        }
    }
}

/* act [n] <- bf16(bf16(silu(gate)) * up), gate_up = [gate | up]; n a multiple of 16. */
static void gated(const uint16_t *gate_up, int64_t n, uint16_t *act) {
    const floats16 one = splat_16(1.0f);
    for (int64_t i = 0; i < n; i += 16) {
        floats16 x = load_16(gate_up, 1, i);
        /* silu(x) = x / (1 + e^-x), as x * e^x / (1 + e^x) below 0: exp_16 only takes x <= 0. */
        floats16 e = exp_16(sub_16(zeros_16(), abs_16(x)));
        floats16 numerator = where_negative_16(x, mul_16(x, e), x);
        floats16 silu = div_16(numerator, add_16(one, e));
        floats16 rounded = widen_16(narrow_16(silu));
        store_bf16_16(act + i, mul_16(rounded, load_16(gate_up, 1, n + i)));
    }
}

/* hidden <- bf16(hidden + delta). */
static void add_residual(uint16_t *hidden, const uint16_t *delta, int64_t n) {
    for (int64_t i = 0; i < n; i += 16)
        store_bf16_16(hidden + i, add_16(load_16(hidden, 1, i), load_16(delta, 1, i)));
}

/* Returns 0; 1 for sizes it does not take (hidden or intermediate not a multiple of 16, head_dim over 512),
   2 when scratch memory could not be had, 3 when a kernel it calls failed. */
int decode_layers(const int64_t *table, int64_t layers, const int64_t *dims, const int64_t *slots,
                  const int64_t *sinks, uint16_t *hidden, const uint16_t *cos, const uint16_t *sin,
                  const float *sink_cos, const float *sink_sin, const float *mask, float eps, float scale,
                  int threads) {
    const int64_t size = dims[HIDDEN_SIZE], dim = dims[HEAD_DIM], q_heads = dims[Q_HEADS], rows = dims[ROWS];
    const int64_t kv_heads = dims[KV_HEADS], inner = dims[INTERMEDIATE], q_size = q_heads * dim;
    const int64_t qkv_size = (q_heads + 2 * kv_heads) * dim;
    if (size % 16 || inner % 16 || dim > 512 || dim % 2 || kv_heads < 1 || q_heads % kv_heads) return 1;
    uint16_t *normed = malloc(sizeof(uint16_t) * rows * (2 * size + qkv_size + 2 * q_size + 3 * inner));
    if (!normed) return 2;
    uint16_t *delta = normed + rows * size, *qkv = delta + rows * size, *query = qkv + rows * qkv_size;
    uint16_t *attended = query + rows * q_size, *gate_up = attended + rows * q_size, *act = gate_up + rows * 2 * inner;
    int failed = 0;
    for (int64_t l = 0; l < layers && !failed; l++) {
        const int64_t *layer = table + l * FIELDS;
        rms_norm(hidden, (const uint16_t *)layer[INPUT_NORM], normed, rows, size, eps);
        failed |= project(layer + QKV, normed, rows, size, qkv_size, qkv, threads);
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t h = 0; h < q_heads + kv_heads; h++)
                rotate(qkv + r * qkv_size + h * dim, dim, cos + r * dim, sin + r * dim);
            memcpy(query + r * q_size, qkv + r * qkv_size, q_size * sizeof *query); /* [rows, kv, groups, dim] */
        }
        write_cache(layer, dims, qkv, slots, sinks, sink_cos, sink_sin);
        const AttentionCache cache = {
            (const void *)layer[KEYS], (const void *)layer[VALUES], dims[KEY_ROW], dims[KEY_HEAD], dims[VALUE_ROW],
            dims[VALUE_HEAD], mask, mask ? dims[EXTENT] : 0, q_heads / kv_heads, dim, dim, dims[EXTENT], 1,
            (int)dims[INT8_CACHE], (const float *)layer[KEY_SCALES], (const float *)layer[VALUE_SCALES],
            dims[SCALE_ROW], dims[SCALE_HEAD], (const void *)layer[SINK_KEYS], (const void *)layer[SINK_VALUES],
            dims[EXACT_ROW], dims[EXACT_HEAD], sinks};
        failed |= attend(&cache, query, attended, rows, kv_heads, scale, threads);
        failed |= project(layer + O_PROJ, attended, rows, q_size, size, delta, threads);
        add_residual(hidden, delta, rows * size);
        rms_norm(hidden, (const uint16_t *)layer[POST_NORM], normed, rows, size, eps);
        failed |= project(layer + GATE_UP, normed, rows, size, 2 * inner, gate_up, threads);
        for (int64_t r = 0; r < rows; r++) gated(gate_up + r * 2 * inner, inner, act + r * inner);
        failed |= project(layer + DOWN, act, rows, inner, size, delta, threads);
        add_residual(hidden, delta, rows * size);
    }
    free(normed);
    return failed ? 3 : 0;
}
