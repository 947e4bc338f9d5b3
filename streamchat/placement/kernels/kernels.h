/* The functions the library exports (placement/native.py binds them), declared once: the kernels that call
   each other (decode_layers.c) and the files that define them agree on their signatures. */
#ifndef STREAMCHAT_KERNELS_H
#define STREAMCHAT_KERNELS_H

#include <stdint.h>

int int4_rows(const void *x, int x_bf16, int64_t rows, int64_t k, const uint8_t *nibbles, const uint16_t *params,
              int64_t n, void *out, int out_bf16, int threads);
int int8_rows(const void *x, int x_bf16, int64_t rows, int64_t k, const int8_t *packed, const float *scales,
              const int32_t *sums, int64_t n, float *out, int threads);
int int8_blocks(const void *x, int x_bf16, int64_t rows, int64_t k, const int8_t *packed, const uint16_t *scales,
                int64_t n, void *out, int out_bf16, int threads);
int decode_attention(const void *query, const void *keys, const void *values, const float *mask, void *out,
                     int64_t batch, int64_t kv_heads, int64_t groups, int64_t dim, int64_t value_dim, int64_t slots,
                     int64_t key_batch, int64_t key_head, int64_t value_batch, int64_t value_head, int64_t mask_batch,
                     float scale, int bf16, int threads);
int decode_attention_int8(const void *query, const int8_t *keys, const int8_t *values, const float *key_scales,
                          const float *value_scales, const void *sink_keys, const void *sink_values,
                          const int64_t *sinks, const float *mask, void *out, const int64_t *shape, float scale,
                          int bf16, int threads);
void rms_norm(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t rows, int64_t dim, float eps);
int decode_layers(const int64_t *table, int64_t layers, const int64_t *dims, const int64_t *slots,
                  const int64_t *sinks, uint16_t *hidden, const uint16_t *cos, const uint16_t *sin,
                  const float *sink_cos, const float *sink_sin, const float *mask, float eps, float scale,
                  int threads);

#endif
