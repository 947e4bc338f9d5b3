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

#if !defined(__AVX512F__)
#include "int16_rows.h"

/* AVX2: an int8 cache's keys of 64 or 128 dims scored on integers. Each query row goes on int16 once (one step a
   row, |q16| <= 32767: about 16 bits, as the products' kernels keep), each slot's levels are widened to int16 once
   for all of the head's query rows, and a slot's products summed by pairs in int32 (128 x 127 x 32767 fits); eight
   slots' sums are reduced together, so no slot pays a horizontal sum of its own. Half the instructions of widening
   each level to float32 for every query row, which left this kernel compute-bound at a full cache (four times
   its bytes' time for 128-dim heads shared by four query rows). */
#define INT_SCORES 1

/* The scores of slots [from, count) for every query row g (scores[g * CHUNK + i]), their largest raised into
   largest[g]: levels times the row's int16 query, scaled by the slot's key scale and the row's step. `vectors`
   (dim / 16: 4 or 8) is a constant where this is inlined. */
static inline __attribute__((always_inline)) void int8_scores(const int vectors, const int8_t *keys,
                                                              const float *key_scales, const float *mask,
                                                              int64_t from, int64_t count, int64_t groups,
                                                              const float *query, float *scores, float *largest) {
    const int dim = 16 * vectors;
    int16_t q16[MAX_GROUPS * 128] __attribute__((aligned(32)));
    int16_t widened[8 * 128] __attribute__((aligned(32))); /* eight slots' levels as int16, read by every row */
    float steps[MAX_GROUPS];
    __m256 largest_of[MAX_GROUPS];
    for (int64_t g = 0; g < groups; g++) {
        steps[g] = quantize_row_int16(query, 0, dim, g * dim, q16 + g * dim); /* a query row, as a row */
        largest_of[g] = _mm256_set1_ps(-INFINITY);
    }
    const __m256 hidden = _mm256_set1_ps(HIDDEN), minus_infinity = _mm256_set1_ps(-INFINITY);
    for (int64_t i = from; i < count; i += 8) {
        const int64_t n = count - i < 8 ? count - i : 8;
        for (int64_t j = 0; j < 8; j++) {
            const int8_t *slot = keys + (i + (j < n ? j : 0)) * dim; /* past the chunk: slot i again, unused */
            for (int v = 0; v < vectors; v++)
                _mm256_store_si256((__m256i *)(widened + j * dim + 16 * v),
                                   _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(slot + 16 * v))));
        }
        const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 scales = _mm256_maskload_ps(key_scales + i, lanes);
        const __m256 added = mask ? _mm256_maskload_ps(mask + i, lanes) : _mm256_setzero_ps();
        /* a masked slot, or a lane past the chunk, scores -infinity */
        const __m256 past = _mm256_xor_ps(_mm256_castsi256_ps(lanes), _mm256_castsi256_ps(_mm256_set1_epi32(-1)));
        const __m256 gone = _mm256_or_ps(_mm256_cmp_ps(added, hidden, _CMP_LE_OQ), past);
        for (int64_t g = 0; g < groups; g++) {
            const __m256i *q = (const __m256i *)(q16 + g * dim);
            __m256i p[8];
            for (int j = 0; j < 8; j++) {
                const __m256i *k = (const __m256i *)(widened + j * dim);
                p[j] = _mm256_add_epi32(_mm256_madd_epi16(k[0], q[0]), _mm256_madd_epi16(k[1], q[1]));
                for (int v = 2; v < vectors; v += 2)
                    p[j] = _mm256_add_epi32(p[j], _mm256_add_epi32(_mm256_madd_epi16(k[v], q[v]),
                                                                   _mm256_madd_epi16(k[v + 1], q[v + 1])));
            }
            /* the eight slots' sums in slot order: pairs, then fours within 128-bit lanes, then the halves */
            __m256i fours = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
            __m256i more = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
            __m256i sums = _mm256_add_epi32(_mm256_permute2x128_si256(fours, more, 0x20),
                                            _mm256_permute2x128_si256(fours, more, 0x31));
            __m256 dots = _mm256_mul_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(scales, _mm256_set1_ps(steps[g])));
            __m256 score = _mm256_blendv_ps(_mm256_add_ps(dots, added), minus_infinity, gone);
            _mm256_maskstore_ps(scores + g * CHUNK + i, lanes, score);
            largest_of[g] = _mm256_max_ps(largest_of[g], score);
        }
    }
    for (int64_t g = 0; g < groups; g++) {
        __m128 four = _mm_max_ps(_mm256_castps256_ps128(largest_of[g]), _mm256_extractf128_ps(largest_of[g], 1));
        four = _mm_max_ps(four, _mm_movehl_ps(four, four));
        largest[g] = fmaxf(largest[g], _mm_cvtss_f32(_mm_max_ss(four, _mm_movehdup_ps(four))));
    }
}

/* The int8 values of slots [from, count) weighed into out[g * dim ..] for `n` query rows from g0 (a constant
   where inlined: their sums stay in registers), 32 dims at a time, each slot's levels widened once for all of
   them. weights[g * CHUNK + i]: the softmax weight times the slot's value scale. */
static inline __attribute__((always_inline)) void weigh_values(const int n, const int64_t dim, const int8_t *values,
                                                              const float *weights, int64_t g0, int64_t from,
                                                              int64_t count, float *out) {
    for (int64_t part = 0; part < dim; part += 32) {
        __m256 acc[3][4];
        for (int g = 0; g < n; g++)
            for (int v = 0; v < 4; v++) acc[g][v] = _mm256_setzero_ps();
        for (int64_t i = from; i < count; i++) {
            const int8_t *slot = values + i * dim + part;
            __m256 level[4];
            for (int v = 0; v < 4; v++)
                level[v] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(slot + 8 * v))));
            for (int g = 0; g < n; g++) {
                const __m256 weight = _mm256_broadcast_ss(weights + (g0 + g) * CHUNK + i);
                for (int v = 0; v < 4; v++) acc[g][v] = _mm256_fmadd_ps(weight, level[v], acc[g][v]);
            }
        }
        for (int g = 0; g < n; g++)
            for (int v = 0; v < 4; v++) {
                float *at = out + (g0 + g) * dim + part + 8 * v;
                _mm256_storeu_ps(at, _mm256_add_ps(_mm256_loadu_ps(at), acc[g][v]));
            }
    }
}

/* weigh_values for every query row, three at a time (what the registers hold). */
static void int8_values(int64_t dim, const int8_t *values, const float *weights, int64_t groups, int64_t from,
                        int64_t count, float *out) {
    for (int64_t g0 = 0; g0 < groups; g0 += 3) {
        const int64_t n = groups - g0;
        if (n >= 3) weigh_values(3, dim, values, weights, g0, from, count, out);
        else if (n == 2) weigh_values(2, dim, values, weights, g0, from, count, out);
        else weigh_values(1, dim, values, weights, g0, from, count, out);
    }
}
#else
#define INT_SCORES 0
#endif

/* A chunk of one head's slots: its maximum score, softmax sum and unnormalised output per query row.
   The scores of every query row come first, each row going over the chunk on its own (the chunk's keys stay in
   cache between rows) so that its dot products sit in registers; then each row's softmax and output, likewise.
   dim_vectors, value_vectors and int8 are constants where this is inlined (attend_chunk's cases). In an int8
   cache the chunk's first `exact` slots are the row's sinks, read from their copies. */
static inline __attribute__((always_inline)) void attend_chunk_with(
    const int64_t dim_vectors, const int64_t value_vectors, const int int8, const AttentionCache *c,
    const float *query, int64_t b, int64_t h, int64_t first, int64_t count, float *maximum, float *total,
    float *out) {
    float scores_of[MAX_GROUPS * CHUNK];
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
    const int int_scores = INT_SCORES && int8 && (dim_vectors == 4 || dim_vectors == 8);
    const int int_values = INT_SCORES && int8 && value_vectors % 2 == 0;
    for (int64_t g = 0; g < c->groups; g++) {
        float *scores = scores_of + g * CHUNK;
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
        for (int64_t i = exact; i < count && !int_scores; i++) { /* int8_scores', where it scores them */
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
    }
#if INT_SCORES
    if (int_scores) /* dim_vectors a constant but where attend_chunk takes the dims as they come */
        int8_scores((int)dim_vectors, (const int8_t *)c->keys + key_at, key_scales, mask, exact, count, c->groups,
                    query, scores_of, maximum);
#endif
    for (int64_t g = 0; g < c->groups; g++) {
        float *scores = scores_of + g * CHUNK;
        const float largest = maximum[g];
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
            for (int64_t i = exact; i < count && !int_values; i++) {
                floats16 weight = splat_16(int8 ? scores[i] * value_scales[i] : scores[i]);
                for (int64_t d = 0; d < value_vectors; d++)
                    acc[d] = fmadd_16(weight, load_slot_16(int8, c->values, c->bf16, value_at + i * c->value_dim + 16 * d),
                                      acc[d]);
            }
        }
        for (int64_t i = exact; i < count && int_values; i++)  /* int8_values' weights; none for a row all masked */
            scores[i] = largest == -INFINITY ? 0.0f : scores[i] * value_scales[i];
        total[g] = sum;
        for (int64_t d = 0; d < value_vectors; d++) storeu_16(out + g * c->value_dim + 16 * d, acc[d]);
    }
#if INT_SCORES
    if (int_values)
        int8_values(c->value_dim, (const int8_t *)c->values + value_at, scores_of, c->groups, exact, count, out);
#endif
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
