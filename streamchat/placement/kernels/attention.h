/* What decode_attention.c's attention reads, shared with decode_layers.c, which calls it for every layer of a
   step: a cache in the model's dtype (float32 or bfloat16, as the query), or an int8 one (--kv-cache int8: each
   slot's key and value of a head as int8 levels with one float32 scale, cache/quantized_kv.py) whose rows'
   first `sinks` slots are read from their exact copies in the query's dtype. */
#ifndef STREAMCHAT_ATTENTION_H
#define STREAMCHAT_ATTENTION_H

#include <stdint.h>

typedef struct {
    const void *keys, *values; /* [batch, kv_heads, slots, dim] at these strides (elements), each slot contiguous */
    int64_t key_batch, key_head, value_batch, value_head;
    const float *mask; /* [batch or 1, slots] added to the scores, or NULL */
    int64_t mask_batch;
    int64_t groups, dim, value_dim, slots;
    int bf16; /* the query's, the output's and (full) the cache's dtype: bfloat16, else float32 */
    int int8; /* keys and values are int8 levels; the fields below are read */
    const float *key_scales, *value_scales; /* [batch, kv_heads, slots] at scale strides */
    int64_t scale_batch, scale_head;
    const void *sink_keys, *sink_values; /* [batch, kv_heads, sink slots, dim] in the query's dtype */
    int64_t sink_batch, sink_head;
    const int64_t *sinks; /* [batch]: slots below sinks[b] are row b's exact sinks */
} AttentionCache;

/* out [batch, kv_heads, groups, value_dim] of query [batch, kv_heads, groups, dim] over `cache`; returns 0, 1 for
   shapes it does not take, 2 when scratch memory could not be had. */
int attend(const AttentionCache *cache, const void *query, void *out, int64_t batch, int64_t kv_heads, float scale,
           int threads);

#endif
