/* One decode query per row attending over a cache: streamchat's own attention kernel.

   Built and loaded by streamchat/placement/native.py; called by streamchat/placement/attention.py.

   query [batch, kv_heads, groups, dim] (a key/value head's query heads as rows, packed as
   decode_attention packs them), keys [batch, kv_heads, slots, dim] and values [.., value_dim] as the
   cache stores them (slots contiguous, any batch and head strides), mask float32 [batch or 1, slots]
   added to the scores (0 or the least float), or none. out [batch, kv_heads, groups, value_dim].

   torch's bfloat16 matrix products cost about 100 us a call on CPU whatever their size (oneDNN builds
   a primitive for every new shape, and a decode step's key count grows every step): two a layer were
   4 ms of a 20 ms step with a short cache. Here one call reads each key and value once for all of a
   head's query rows, in float32 throughout (the scores are not rounded to bfloat16), split over
   threads by head and by CHUNK slots (flash-decoding: each chunk's softmax is merged after).

   An int8 cache (attention.h) is read as it is stored: a slot's levels widened in registers, its dot product
   scaled by its key scale and its softmax weight by its value scale, half the bytes of bfloat16 read; its
   rows' sinks from their exact copies. */
#include <math.h>
#include <stdlib.h>

#include "attention.h"
#include "bfloat16.h"
#include "kernels.h"
#include "vector_exp.h"
#include "vectors.h"

#define CHUNK 256
#define MAX_GROUPS 16
#define MAX_DIM 256
#define HIDDEN -1e30f /* a score at or below this is a masked slot */

/* 16 values of a cache slot's vector at element `at`: int8 levels (to be scaled), else the cache's dtype. */
static inline __attribute__((always_inline)) floats16 load_slot_16(const int int8, const void *x, int bf16,
                                                                    int64_t at) {
    return int8 ? load_int8_16((const int8_t *)x + at) : load_16(x, bf16, at);
}

/* A chunk of one head's slots: its maximum score, softmax sum and unnormalised output per query row.
   Each query row goes over the chunk on its own (the chunk's keys and values stay in cache between rows),
   so that its dot products and its output sit in registers: dim_vectors, value_vectors and int8 are
   constants where this is inlined (attend_chunk's cases). In an int8 cache the chunk's first `exact`
   slots are the row's sinks, read from their copies. */
static inline __attribute__((always_inline)) void attend_chunk_with(
    const int64_t dim_vectors, const int64_t value_vectors, const int int8, const AttentionCache *c,
    const float *query, int64_t b, int64_t h, int64_t first, int64_t count, float *maximum, float *total,
    float *out) {
    float scores[CHUNK];
    const int64_t key_at = b * c->key_batch + h * c->key_head + first * c->dim;
    const int64_t value_at = b * c->value_batch + h * c->value_head + first * c->value_dim;
    const float *mask = c->mask ? c->mask + b * c->mask_batch + first : NULL;
    int64_t exact = 0;
    const float *key_scales = NULL, *value_scales = NULL;
    int64_t sink_at = 0;
    if (int8) {
        exact = c->sinks[b] - first;
        exact = exact < 0 ? 0 : exact > count ? count : exact;
        key_scales = c->key_scales + b * c->scale_batch + h * c->scale_head + first;
        value_scales = c->value_scales + b * c->scale_batch + h * c->scale_head + first;
        sink_at = b * c->sink_batch + h * c->sink_head + first * c->dim;
    }
    for (int64_t g = 0; g < c->groups; g++) {
        floats16 q[MAX_DIM / 16];
        for (int64_t d = 0; d < dim_vectors; d++) q[d] = loadu_16(query + g * c->dim + 16 * d);
        float largest = -INFINITY;
        for (int64_t i = 0; i < exact; i++) {
            floats16 dot = zeros_16();
            for (int64_t d = 0; d < dim_vectors; d++)
                dot = fmadd_16(q[d], load_16(c->sink_keys, c->bf16, sink_at + i * c->dim + 16 * d), dot);
            float added = mask ? mask[i] : 0.0f;
            float score = added <= HIDDEN ? -INFINITY : sum_16(dot) + added;
            scores[i] = score;
            largest = score > largest ? score : largest;
        }
        for (int64_t i = exact; i < count; i++) {
            floats16 dot = zeros_16();
            for (int64_t d = 0; d < dim_vectors; d++)
                dot = fmadd_16(q[d], load_slot_16(int8, c->keys, c->bf16, key_at + i * c->dim + 16 * d), dot);
            float added = mask ? mask[i] : 0.0f;
            float product = int8 ? sum_16(dot) * key_scales[i] : sum_16(dot);
            float score = added <= HIDDEN ? -INFINITY : product + added;
            scores[i] = score;
            largest = score > largest ? score : largest;
        }
        maximum[g] = largest;
        floats16 acc[MAX_DIM / 16];
        for (int64_t d = 0; d < value_vectors; d++) acc[d] = zeros_16();
        float sum = 0.0f;
        if (largest != -INFINITY) {
            for (int64_t i = 0; i < count; i += 16) {
                floats16 shifted = sub_16(load_first_16(scores + i, count - i), splat_16(largest));
                floats16 weights = keep_first_16(exp_16(shifted), count - i);
                store_first_16(scores + i, weights, count - i);
                sum += sum_16(weights);
            }
            for (int64_t i = 0; i < exact; i++) {
                floats16 weight = splat_16(scores[i]);
                for (int64_t d = 0; d < value_vectors; d++)
                    acc[d] = fmadd_16(weight, load_16(c->sink_values, c->bf16, sink_at + i * c->value_dim + 16 * d),
                                      acc[d]);
            }
            for (int64_t i = exact; i < count; i++) {
                floats16 weight = splat_16(int8 ? scores[i] * value_scales[i] : scores[i]);
                for (int64_t d = 0; d < value_vectors; d++)
                    acc[d] = fmadd_16(weight, load_slot_16(int8, c->values, c->bf16, value_at + i * c->value_dim + 16 * d),
                                      acc[d]);
            }
        }
        total[g] = sum;
        for (int64_t d = 0; d < value_vectors; d++) storeu_16(out + g * c->value_dim + 16 * d, acc[d]);
    }
}

static void attend_chunk(const AttentionCache *c, const float *query, int64_t b, int64_t h, int64_t first,
                         int64_t count, float *maximum, float *total, float *out) {
    if (c->dim == 64 && c->value_dim == 64 && c->int8)
        attend_chunk_with(4, 4, 1, c, query, b, h, first, count, maximum, total, out);
    else if (c->dim == 64 && c->value_dim == 64)
        attend_chunk_with(4, 4, 0, c, query, b, h, first, count, maximum, total, out);
    else if (c->dim == 128 && c->value_dim == 128 && c->int8)
        attend_chunk_with(8, 8, 1, c, query, b, h, first, count, maximum, total, out);
    else if (c->dim == 128 && c->value_dim == 128)
        attend_chunk_with(8, 8, 0, c, query, b, h, first, count, maximum, total, out);
    else if (c->int8)
        attend_chunk_with(c->dim / 16, c->value_dim / 16, 1, c, query, b, h, first, count, maximum, total, out);
    else
        attend_chunk_with(c->dim / 16, c->value_dim / 16, 0, c, query, b, h, first, count, maximum, total, out);
}

/* Returns 0; 1 for shapes it does not take (dim or value_dim not a multiple of 16 or over MAX_DIM, more
   than MAX_GROUPS query rows a head), 2 when scratch memory could not be had. */
int attend(const AttentionCache *cache, const void *query, void *out, int64_t batch, int64_t kv_heads, float scale,
           int threads) {
    const int64_t groups = cache->groups, dim = cache->dim, value_dim = cache->value_dim, slots = cache->slots;
    const int bf16 = cache->bf16;
    if (dim % 16 || value_dim % 16 || dim > MAX_DIM || value_dim > MAX_DIM || groups > MAX_GROUPS || groups < 1)
        return 1;
    const int64_t chunks = slots > 0 ? (slots + CHUNK - 1) / CHUNK : 1, heads = batch * kv_heads;
    const int64_t per_chunk = groups * (2 + value_dim);
    float *queries = malloc(sizeof(float) * heads * groups * dim);
    float *partial = malloc(sizeof(float) * heads * chunks * per_chunk);
    if (!queries || !partial) {
        free(queries), free(partial);
        return 2;
    }
    for (int64_t i = 0; i < heads * groups * dim; i++) {
        float q = bf16 ? bf16_to_float(((const uint16_t *)query)[i]) : ((const float *)query)[i];
        queries[i] = q * scale;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t unit = 0; unit < heads * chunks; unit++) {
        int64_t head = unit / chunks, chunk = unit % chunks, first = chunk * CHUNK;
        int64_t count = slots - first < CHUNK ? slots - first : CHUNK;
        float *at = partial + unit * per_chunk;
        attend_chunk(cache, queries + head * groups * dim, head / kv_heads, head % kv_heads, first,
                     count > 0 ? count : 0, at, at + groups, at + 2 * groups);
    }
    /* Merge each head's chunks: scale each by e^(its maximum - the head's), divide by the merged sum. */
    for (int64_t head = 0; head < heads; head++) {
        for (int64_t g = 0; g < groups; g++) {
            float largest = -INFINITY, sum = 0.0f;
            for (int64_t chunk = 0; chunk < chunks; chunk++) {
                float m = partial[(head * chunks + chunk) * per_chunk + g];
                largest = m > largest ? m : largest;
            }
            float merged[MAX_DIM] = {0};
            for (int64_t chunk = 0; chunk < chunks; chunk++) {
                const float *at = partial + (head * chunks + chunk) * per_chunk;
                if (at[g] == -INFINITY) continue;
                float weight = expf(at[g] - largest);
                sum += weight * at[groups + g];
                for (int64_t d = 0; d < value_dim; d++) merged[d] += weight * at[2 * groups + g * value_dim + d];
            }
            float inverse = sum > 0.0f ? 1.0f / sum : 0.0f;
            int64_t out_at = (head * groups + g) * value_dim;
            for (int64_t d = 0; d < value_dim; d++) {
                if (bf16) ((uint16_t *)out)[out_at + d] = float_to_bf16(merged[d] * inverse);
                else ((float *)out)[out_at + d] = merged[d] * inverse;
            }
        }
    }
    free(queries), free(partial);
    return 0;
}

int decode_attention(const void *query, const void *keys, const void *values, const float *mask, void *out,
                     int64_t batch, int64_t kv_heads, int64_t groups, int64_t dim, int64_t value_dim, int64_t slots,
                     int64_t key_batch, int64_t key_head, int64_t value_batch, int64_t value_head, int64_t mask_batch,
                     float scale, int bf16, int threads) {
    const AttentionCache cache = {keys,      values, key_batch, key_head, value_batch, value_head, mask, mask_batch,
                                  groups,    dim,    value_dim, slots,    bf16,        0,
                                  NULL,      NULL,   0,         0,        NULL,        NULL,
                                  0,         0,      NULL}; /* a full cache: no scales, no sinks apart */
    return attend(&cache, query, out, batch, kv_heads, scale, threads);
}

/* shape: batch, kv_heads, groups, dim, slots, then the strides (elements) of keys and values (alike), of their
   scales (alike), of the exact sinks (alike) and of the mask, each batch then head (the mask's batch only). */
int decode_attention_int8(const void *query, const int8_t *keys, const int8_t *values, const float *key_scales,
                          const float *value_scales, const void *sink_keys, const void *sink_values,
                          const int64_t *sinks, const float *mask, void *out, const int64_t *shape, float scale,
                          int bf16, int threads) {
    const AttentionCache cache = {
        keys,      values,   shape[5],  shape[6], shape[5], shape[6], mask,      shape[11], shape[2], shape[3],
        shape[3],  shape[4], bf16,      1,        key_scales, value_scales, shape[7], shape[8], sink_keys,
        sink_values, shape[9], shape[10], sinks};
    return attend(&cache, query, out, shape[0], shape[1], scale, threads);
}
