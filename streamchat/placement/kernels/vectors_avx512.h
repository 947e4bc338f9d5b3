/* vectors.h on AVX-512 (with VNNI): each vector one register. */
#ifndef STREAMCHAT_VECTORS_AVX512_H
#define STREAMCHAT_VECTORS_AVX512_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

typedef __m512 floats16;
typedef __m512i ints16;
typedef __m512i bytes64;

static inline floats16 zeros_16(void) { return _mm512_setzero_ps(); }
static inline floats16 splat_16(float value) { return _mm512_set1_ps(value); }
static inline floats16 loadu_16(const float *at) { return _mm512_loadu_ps(at); }
static inline void storeu_16(float *at, floats16 x) { _mm512_storeu_ps(at, x); }
static inline floats16 add_16(floats16 a, floats16 b) { return _mm512_add_ps(a, b); }
static inline floats16 sub_16(floats16 a, floats16 b) { return _mm512_sub_ps(a, b); }
static inline floats16 mul_16(floats16 a, floats16 b) { return _mm512_mul_ps(a, b); }
static inline floats16 div_16(floats16 a, floats16 b) { return _mm512_div_ps(a, b); }
static inline floats16 max_16(floats16 a, floats16 b) { return _mm512_max_ps(a, b); }
static inline floats16 abs_16(floats16 x) { return _mm512_abs_ps(x); }
static inline floats16 fmadd_16(floats16 a, floats16 b, floats16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline floats16 fnmadd_16(floats16 a, floats16 b, floats16 c) { return _mm512_fnmadd_ps(a, b, c); }
static inline float sum_16(floats16 x) { return _mm512_reduce_add_ps(x); }
static inline float largest_16(floats16 x) { return _mm512_reduce_max_ps(x); }
static inline floats16 round_16(floats16 x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* The first `count` (0..16) values at `at`, zeros after; stored back the same way; kept, zeros after. */
static inline __mmask16 first_lanes(int64_t count) { return count >= 16 ? 0xFFFF : (__mmask16)((1u << count) - 1); }
static inline floats16 load_first_16(const float *at, int64_t count) { return _mm512_maskz_loadu_ps(first_lanes(count), at); }
static inline void store_first_16(float *at, floats16 x, int64_t count) { _mm512_mask_storeu_ps(at, first_lanes(count), x); }
static inline floats16 keep_first_16(floats16 x, int64_t count) { return _mm512_maskz_mov_ps(first_lanes(count), x); }

/* x where x >= limit, else 0. */
static inline floats16 zero_below_16(floats16 x, floats16 value, float limit) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(limit), _CMP_GE_OQ), value);
}
/* if_negative where x < 0, else otherwise. */
static inline floats16 where_negative_16(floats16 x, floats16 if_negative, floats16 otherwise) {
    return _mm512_mask_mov_ps(otherwise, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), if_negative);
}
/* p * 2^n, n integral. */
static inline floats16 scale_by_power_of_two_16(floats16 p, floats16 n) { return _mm512_scalef_ps(p, n); }

/* 16 bfloat16 values as float32 (exactly), and float32 rounded to bfloat16 as torch rounds (ties to even). */
static inline floats16 widen_16(__m256i half) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
static inline __m256i narrow_16(floats16 x) {
    __m512i bits = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
}
/* 16 int8 values as float32 (exactly). */
static inline floats16 load_int8_16(const int8_t *at) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)at)));
}
/* 16 float16 values as float32. */
static inline floats16 widen_half_16(const uint16_t *at) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)at)); }

/* 16 integral floats as int8, saturated, stored at `at`. */
static inline void store_int8_16(int8_t *at, floats16 integral) {
    _mm_storeu_si128((__m128i *)at, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(integral)));
}

/* ---- the products' integer lanes: 16 int32 sums, 64 bytes of weights (4 inputs of 16 outputs) ---- */
static inline floats16 int_to_floats_16(ints16 x) { return _mm512_cvtepi32_ps(x); }
static inline bytes64 load_bytes_64(const void *at) { return _mm512_loadu_si512(at); }
static inline bytes64 low_nibbles_64(bytes64 x) { return _mm512_and_si512(x, _mm512_set1_epi8(0x0F)); }
static inline bytes64 high_nibbles_64(bytes64 x) {
    return _mm512_and_si512(_mm512_srli_epi16(x, 4), _mm512_set1_epi8(0x0F));
}
/* The int4 kernel's integer part, one group of 32 inputs for `rows` (<= INT4_ROW_BLOCK) activation rows, a
   row every `stride` bytes of `levels` and of their `residuals`: the 16 outputs' dot products with each, the
   weights unsigned (0..15), the levels signed. The group's 8 weight vectors are unpacked once and held in
   registers for every row (32 of them: 8 rows' sums fit beside). */
#define INT4_ROW_BLOCK 8
static inline __attribute__((always_inline)) void group_dots_16(const int rows, const uint8_t *nibbles,
                                                                const int8_t *levels, const int8_t *residuals,
                                                                int64_t stride, ints16 *dots, ints16 *rest_dots) {
    bytes64 weights[8]; /* inputs 4 j .. 4 j + 3 of the group, for the 16 outputs */
    for (int p = 0; p < 4; p++) {
        bytes64 packed = load_bytes_64(nibbles + 64 * p);
        weights[2 * p] = low_nibbles_64(packed);
        weights[2 * p + 1] = high_nibbles_64(packed);
    }
    for (int r = 0; r < rows; r++) {
        const int8_t *row = levels + r * stride, *rest = residuals + r * stride;
        __m512i dot = _mm512_setzero_si512(), rest_dot = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            int32_t four, rest_four;
            memcpy(&four, row + 4 * j, sizeof four);
            memcpy(&rest_four, rest + 4 * j, sizeof rest_four);
            dot = _mm512_dpbusd_epi32(dot, weights[j], _mm512_set1_epi32(four));
            rest_dot = _mm512_dpbusd_epi32(rest_dot, weights[j], _mm512_set1_epi32(rest_four));
        }
        dots[r] = dot, rest_dots[r] = rest_dot;
    }
}

#endif
