/* RMSNorm of bfloat16 rows as LlamaRMSNorm computes it, in one call: streamchat's own kernel.

   Built and loaded by streamchat/placement/native.py; called by streamchat/placement/lean_forward.py.

   out = weight * bf16(x * rsqrt(mean(x^2) + eps)), x widened to float32, the normalised row rounded to
   bfloat16 before the weight's product (rounded again): transformers' operations in transformers' dtypes.
   Eager torch runs those as nine calls of a few microseconds each, 61 norms a decode step of the
   default model. dim a multiple of 16. */
#include <math.h>

#include "bfloat16.h"
#include "kernels.h"

void rms_norm(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = x + r * dim;
        __m512 squares = _mm512_setzero_ps();
        for (int64_t i = 0; i < dim; i += 16) {
            __m512 v = load_16(row, 1, i);
            squares = _mm512_fmadd_ps(v, v, squares);
        }
        __m512 inverse = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)dim + eps));
        for (int64_t i = 0; i < dim; i += 16) {
            __m512 rounded = widen_16(narrow_16(_mm512_mul_ps(load_16(row, 1, i), inverse)));
            __m512 weighted = _mm512_mul_ps(load_16(weight, 1, i), rounded);
            _mm256_storeu_si256((__m256i *)(out + r * dim + i), narrow_16(weighted));
        }
    }
}
