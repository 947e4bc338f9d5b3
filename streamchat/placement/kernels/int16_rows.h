/* What the AVX2 products on int16 activations share (int8_rows_avx2.c: the output head; int8_blocks.c: int8
   layers in blocks; decode_attention.c: query rows over an int8 cache): a row quantized once to int16 levels
   (one step a row, |a16| <= 32767: about the 16 bits int8_rows.c's two parts keep), and the weights' tiles
   [n / 16, k / 4, 16, 4] multiplied by such rows, each int8 weight widened to int16 as it is read and the
   products summed by pairs in int32 (one multiply-add per 16 weights). AVX2 intrinsics alone: the AVX-512 build
   compiles them too. */
#ifndef STREAMCHAT_INT16_ROWS_H
#define STREAMCHAT_INT16_ROWS_H

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INT16_LEVELS 32767.0f
#define INT16_ROW_BLOCK 4 /* the most rows a pass over a tile takes */

/* 8 values of x[at] (bfloat16 if bf16, else float32) as float32. */
static inline __m256 load_8(const void *x, int bf16, int64_t at) {
    if (!bf16) return _mm256_loadu_ps((const float *)x + at);
    __m128i half = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + at));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

/* x[at .. at + k] as int16 levels; returns its step. k a multiple of 16. */
static inline float quantize_row_int16(const void *x, int bf16, int64_t k, int64_t at, int16_t *levels) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 largest = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8)
        largest = _mm256_max_ps(largest, _mm256_and_ps(load_8(x, bf16, at + i), magnitude));
    __m128 four = _mm_max_ps(_mm256_castps256_ps128(largest), _mm256_extractf128_ps(largest, 1));
    four = _mm_max_ps(four, _mm_movehl_ps(four, four));
    float step = _mm_cvtss_f32(_mm_max_ss(four, _mm_movehdup_ps(four))) / INT16_LEVELS;
    const __m256 inverse = _mm256_set1_ps(step > 0.0f ? 1.0f / step : 0.0f);
    for (int64_t i = 0; i < k; i += 16) {
        __m256i low = _mm256_cvtps_epi32(_mm256_mul_ps(load_8(x, bf16, at + i), inverse));
        __m256i high = _mm256_cvtps_epi32(_mm256_mul_ps(load_8(x, bf16, at + i + 8), inverse));
        /* packs works within 128-bit lanes (low 0-3, high 0-3 | low 4-7, high 4-7): the permute restores order */
        _mm256_storeu_si256((__m256i *)(levels + i), _mm256_permute4x64_epi64(_mm256_packs_epi32(low, high), 0xD8));
    }
    return step;
}

/* Every row of x [rows, k] as int16 levels into *levels [rows, k] and its step into *steps [rows], both allocated
   here (the caller frees them); returns 1, with nothing allocated, when the memory could not be had. */
static inline int int16_rows(const void *x, int bf16, int64_t rows, int64_t k, int16_t **levels, float **steps) {
    *levels = malloc(sizeof(int16_t) * rows * k);
    *steps = malloc(sizeof(float) * rows);
    if (!*levels || !*steps) {
        free(*levels), free(*steps);
        return 1;
    }
    for (int64_t r = 0; r < rows; r++) (*steps)[r] = quantize_row_int16(x, bf16, k, r * k, *levels + r * k);
    return 0;
}

/* Quads [first, last) of a tile (4 inputs of its 16 outputs each) times `rows` rows of int16 levels, added to
   pairs[r][q]: quarter q holds outputs 4 q .. 4 q + 3, two int32 pair sums each. */
static inline __attribute__((always_inline)) void add_quads(const int rows, const int8_t *packed,
                                                            const int16_t *levels, int64_t k, int64_t first,
                                                            int64_t last, __m256i pairs[][4]) {
    for (int64_t quad = first; quad < last; quad++) {
        __m256i weights[4]; /* outputs 4 q .. 4 q + 3, their 4 inputs each, widened to int16 */
        for (int q = 0; q < 4; q++)
            weights[q] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(packed + quad * 64 + 16 * q)));
        for (int r = 0; r < rows; r++) {
            int64_t four;
            memcpy(&four, levels + r * k + 4 * quad, sizeof four);
            const __m256i inputs = _mm256_set1_epi64x(four);
            for (int q = 0; q < 4; q++)
                pairs[r][q] = _mm256_add_epi32(pairs[r][q], _mm256_madd_epi16(weights[q], inputs));
        }
    }
}

/* Eight outputs' sums from two quarters' pair sums (add_quads'), as float32. */
static inline __m256 outputs_8(__m256i first, __m256i second) {
    /* hadd pairs within 128-bit lanes (outputs 0 1 4 5 | 2 3 6 7); the permute restores their order */
    return _mm256_cvtepi32_ps(_mm256_permute4x64_epi64(_mm256_hadd_epi32(first, second), 0xD8));
}

#endif
