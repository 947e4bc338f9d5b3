/* vectors.h on AVX2 (with FMA and F16C): each vector two 8-lane registers, low lanes then high. The
   integer products take VNNI's place with AVX2's byte multiply-add (pairs into int16, then int32), whose
   int16 pairs cannot overflow for the levels the kernels make (|level| <= 127, int4 weights <= 15). */
#ifndef STREAMCHAT_VECTORS_AVX2_H
#define STREAMCHAT_VECTORS_AVX2_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    __m256 low, high;
} floats16;
typedef struct {
    __m256i low, high;
} ints16;
typedef ints16 bytes64;

#define LANES_2(expression_low, expression_high) ((floats16){expression_low, expression_high})
static inline floats16 zeros_16(void) { return LANES_2(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline floats16 splat_16(float value) { return LANES_2(_mm256_set1_ps(value), _mm256_set1_ps(value)); }
static inline floats16 loadu_16(const float *at) { return LANES_2(_mm256_loadu_ps(at), _mm256_loadu_ps(at + 8)); }
static inline void storeu_16(float *at, floats16 x) { _mm256_storeu_ps(at, x.low), _mm256_storeu_ps(at + 8, x.high); }
static inline floats16 add_16(floats16 a, floats16 b) {
    return LANES_2(_mm256_add_ps(a.low, b.low), _mm256_add_ps(a.high, b.high));
}
static inline floats16 sub_16(floats16 a, floats16 b) {
    return LANES_2(_mm256_sub_ps(a.low, b.low), _mm256_sub_ps(a.high, b.high));
}
static inline floats16 mul_16(floats16 a, floats16 b) {
    return LANES_2(_mm256_mul_ps(a.low, b.low), _mm256_mul_ps(a.high, b.high));
}
static inline floats16 div_16(floats16 a, floats16 b) {
    return LANES_2(_mm256_div_ps(a.low, b.low), _mm256_div_ps(a.high, b.high));
}
static inline floats16 max_16(floats16 a, floats16 b) {
    return LANES_2(_mm256_max_ps(a.low, b.low), _mm256_max_ps(a.high, b.high));
}
static inline floats16 abs_16(floats16 x) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    return LANES_2(_mm256_and_ps(x.low, magnitude), _mm256_and_ps(x.high, magnitude));
}
static inline floats16 fmadd_16(floats16 a, floats16 b, floats16 c) {
    return LANES_2(_mm256_fmadd_ps(a.low, b.low, c.low), _mm256_fmadd_ps(a.high, b.high, c.high));
}
static inline floats16 fnmadd_16(floats16 a, floats16 b, floats16 c) {
    return LANES_2(_mm256_fnmadd_ps(a.low, b.low, c.low), _mm256_fnmadd_ps(a.high, b.high, c.high));
}
static inline float sum_16(floats16 x) {
    __m256 eight = _mm256_add_ps(x.low, x.high);
    __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
    four = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(four, _mm_movehdup_ps(four)));
}
static inline float largest_16(floats16 x) {
    __m256 eight = _mm256_max_ps(x.low, x.high);
    __m128 four = _mm_max_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
    four = _mm_max_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_max_ss(four, _mm_movehdup_ps(four)));
}
static inline floats16 round_16(floats16 x) {
    const int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return LANES_2(_mm256_round_ps(x.low, nearest), _mm256_round_ps(x.high, nearest));
}

/* The first `count` (0..16) values at `at`, zeros after; stored back the same way (lanes past `count`
   are neither read nor written); kept, zeros after. */
static inline __m256i first_lanes(int64_t count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline floats16 load_first_16(const float *at, int64_t count) {
    return LANES_2(_mm256_maskload_ps(at, first_lanes(count)), _mm256_maskload_ps(at + 8, first_lanes(count - 8)));
}
static inline void store_first_16(float *at, floats16 x, int64_t count) {
    _mm256_maskstore_ps(at, first_lanes(count), x.low), _mm256_maskstore_ps(at + 8, first_lanes(count - 8), x.high);
}
static inline floats16 keep_first_16(floats16 x, int64_t count) {
    return LANES_2(_mm256_and_ps(x.low, _mm256_castsi256_ps(first_lanes(count))),
                   _mm256_and_ps(x.high, _mm256_castsi256_ps(first_lanes(count - 8))));
}

/* value where x >= limit, else 0. */
static inline floats16 zero_below_16(floats16 x, floats16 value, float limit) {
    const __m256 bound = _mm256_set1_ps(limit);
    return LANES_2(_mm256_and_ps(_mm256_cmp_ps(x.low, bound, _CMP_GE_OQ), value.low),
                   _mm256_and_ps(_mm256_cmp_ps(x.high, bound, _CMP_GE_OQ), value.high));
}
/* if_negative where x < 0, else otherwise. */
static inline floats16 where_negative_16(floats16 x, floats16 if_negative, floats16 otherwise) {
    const __m256 zero = _mm256_setzero_ps();
    return LANES_2(_mm256_blendv_ps(otherwise.low, if_negative.low, _mm256_cmp_ps(x.low, zero, _CMP_LT_OQ)),
                   _mm256_blendv_ps(otherwise.high, if_negative.high, _mm256_cmp_ps(x.high, zero, _CMP_LT_OQ)));
}
/* p * 2^n, n integral within -126..127 (a normal float's exponents: exp_16's range). */
static inline __m256 power_of_two_8(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline floats16 scale_by_power_of_two_16(floats16 p, floats16 n) {
    return LANES_2(_mm256_mul_ps(p.low, power_of_two_8(n.low)), _mm256_mul_ps(p.high, power_of_two_8(n.high)));
}

/* 16 bfloat16 values as float32 (exactly), and float32 rounded to bfloat16 as torch rounds (ties to even). */
static inline __m256 widen_8(__m128i half) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
static inline floats16 widen_16(__m256i half) {
    return LANES_2(widen_8(_mm256_castsi256_si128(half)), widen_8(_mm256_extracti128_si256(half, 1)));
}
static inline __m256i rounded_top_halves_8(__m256 x) {
    __m256i bits = _mm256_castps_si256(x);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    bits = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
    return _mm256_srli_epi32(bits, 16);
}
static inline __m256i narrow_16(floats16 x) {
    /* packus interleaves the 128-bit lanes (low 0-3, high 0-3, low 4-7, high 4-7): the permute restores order */
    __m256i packed = _mm256_packus_epi32(rounded_top_halves_8(x.low), rounded_top_halves_8(x.high));
    return _mm256_permute4x64_epi64(packed, 0xD8);
}
/* 16 int8 values as float32 (exactly). */
static inline floats16 load_int8_16(const int8_t *at) {
    __m128i bytes = _mm_loadu_si128((const __m128i *)at);
    return LANES_2(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)),
                   _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8))));
}
/* 16 float16 values as float32. */
static inline floats16 widen_half_16(const uint16_t *at) {
    return LANES_2(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)at)),
                   _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(at + 8))));
}

/* 16 floats rounded to the nearest int16 (saturated), in order. */
static inline __m256i int16_16(floats16 x) {
    __m256i words = _mm256_packs_epi32(_mm256_cvtps_epi32(x.low), _mm256_cvtps_epi32(x.high));
    return _mm256_permute4x64_epi64(words, 0xD8); /* as narrow_16 */
}
/* 16 floats rounded to the nearest int8 (saturated), stored at `at`. */
static inline void store_int8_16(int8_t *at, floats16 x) {
    __m256i words = int16_16(x);
    _mm_storeu_si128((__m128i *)at, _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1)));
}

/* ---- the products' integer lanes: 16 int32 sums, 64 bytes of weights (4 inputs of 16 outputs) ---- */
static inline floats16 int_to_floats_16(ints16 x) { return LANES_2(_mm256_cvtepi32_ps(x.low), _mm256_cvtepi32_ps(x.high)); }
static inline bytes64 load_bytes_64(const void *at) {
    return (bytes64){_mm256_loadu_si256((const __m256i *)at), _mm256_loadu_si256((const __m256i *)at + 1)};
}
static inline bytes64 low_nibbles_64(bytes64 x) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    return (bytes64){_mm256_and_si256(x.low, nibble), _mm256_and_si256(x.high, nibble)};
}
static inline bytes64 high_nibbles_64(bytes64 x) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    return (bytes64){_mm256_and_si256(_mm256_srli_epi16(x.low, 4), nibble),
                     _mm256_and_si256(_mm256_srli_epi16(x.high, 4), nibble)};
}
/* The int4 kernel's integer part, one group of 32 inputs for `rows` (<= INT4_ROW_BLOCK) activation rows, a
   row every `stride` bytes of `levels` and of their `residuals`: the 16 outputs' dot products with each, the
   weights unsigned (0..15), the levels signed. 16 registers do not hold a group's weights and the rows'
   sums, so the group is walked a packed vector at a time for 2 rows; the byte products' int16 pairs are
   added up over the group and widened to int32 once (8 x 2 x 15 x 128 fits an int16). */
#define INT4_ROW_BLOCK 2
static inline __m256i add_products_8(__m256i sums, __m256i weights, const int8_t *levels) {
    int32_t four;
    memcpy(&four, levels, sizeof four);
    return _mm256_add_epi16(sums, _mm256_maddubs_epi16(weights, _mm256_set1_epi32(four)));
}
static inline __attribute__((always_inline)) void group_dots_16(const int rows, const uint8_t *nibbles,
                                                                const int8_t *levels, const int8_t *residuals,
                                                                int64_t stride, ints16 *dots, ints16 *rest_dots) {
    ints16 dot[8], rest_dot[8]; /* int16 pairs, low and high 8 outputs (for up to int4_rows.c's 8 rows) */
    for (int r = 0; r < rows; r++) dot[r] = rest_dot[r] = (ints16){_mm256_setzero_si256(), _mm256_setzero_si256()};
#pragma GCC unroll 1 /* unrolled, GCC hoists the byte products ahead of their sums and spills them */
    for (int p = 0; p < 4; p++) {
        /* inputs 8 p .. 8 p + 3 in the low nibbles, 8 p + 4 .. 8 p + 7 in the high ones */
        bytes64 packed = load_bytes_64(nibbles + 64 * p), low = low_nibbles_64(packed), high = high_nibbles_64(packed);
        for (int r = 0; r < rows; r++) {
            const int8_t *row = levels + r * stride + 8 * p, *rest = residuals + r * stride + 8 * p;
            dot[r].low = add_products_8(add_products_8(dot[r].low, low.low, row), high.low, row + 4);
            dot[r].high = add_products_8(add_products_8(dot[r].high, low.high, row), high.high, row + 4);
            rest_dot[r].low = add_products_8(add_products_8(rest_dot[r].low, low.low, rest), high.low, rest + 4);
            rest_dot[r].high = add_products_8(add_products_8(rest_dot[r].high, low.high, rest), high.high, rest + 4);
        }
    }
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < rows; r++) {
        dots[r] = (ints16){_mm256_madd_epi16(dot[r].low, ones), _mm256_madd_epi16(dot[r].high, ones)};
        rest_dots[r] = (ints16){_mm256_madd_epi16(rest_dot[r].low, ones), _mm256_madd_epi16(rest_dot[r].high, ones)};
    }
}

#undef LANES_2
#endif
