/* What streamchat's kernels share: activations read as float32 whatever they are stored in, results
   rounded back to bfloat16 as torch rounds them (to nearest, ties to even; NaN aside). */
#ifndef STREAMCHAT_BFLOAT16_H
#define STREAMCHAT_BFLOAT16_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* 16 bfloat16 values as float32 (exactly). */
static inline __m512 widen_16(__m256i half) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

/* 16 values from x[at], bfloat16 if bf16, else float32, as float32. */
static inline __m512 load_16(const void *x, int bf16, int64_t at) {
    if (!bf16) return _mm512_loadu_ps((const float *)x + at);
    return widen_16(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + at)));
}

static inline float bf16_to_float(uint16_t value) {
    uint32_t bits = (uint32_t)value << 16;
    float wide;
    memcpy(&wide, &bits, sizeof wide);
    return wide;
}

static inline uint16_t float_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

/* float_to_bf16, 16 at a time. */
static inline __m256i narrow_16(__m512 x) {
    __m512i bits = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
}

#endif
