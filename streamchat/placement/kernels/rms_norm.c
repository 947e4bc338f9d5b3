/* RMSNorm of bfloat16 rows as LlamaRMSNorm computes it, in one call: streamchat's own kernel.

   Built and loaded by streamchat/placement/native.py; called by streamchat/placement/lean_forward.py.

   out = weight * bf16(x * rsqrt(mean(x^2) + eps)), x widened to float32, the normalised row rounded to
   bfloat16 before the weight's product (rounded again): transformers' operations in transformers' dtypes.
   Eager torch runs those as nine calls of a few microseconds each, 61 norms a decode step of the
   default model. dim a multiple of 16. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline __m512 widen(const uint16_t *at) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)at)), 16));
}

/* Round to the nearest bfloat16, ties to even (NaN aside), 16 at a time. */
static inline __m256i narrow(__m512 x) {
    __m512i bits = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
}

void rms_norm(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = x + r * dim;
        __m512 squares = _mm512_setzero_ps();
        for (int64_t i = 0; i < dim; i += 16) {
            __m512 v = widen(row + i);
            squares = _mm512_fmadd_ps(v, v, squares);
        }
        __m512 inverse = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)dim + eps));
        for (int64_t i = 0; i < dim; i += 16) {
            __m256i rounded = narrow(_mm512_mul_ps(widen(row + i), inverse));
            __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16));
            _mm256_storeu_si256((__m256i *)(out + r * dim + i), narrow(_mm512_mul_ps(widen(weight + i), back)));
        }
    }
}
