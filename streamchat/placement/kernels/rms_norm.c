/* RMSNorm of bfloat16 rows as LlamaRMSNorm computes it, in one call: streamchat's own kernel.

   Built and loaded by streamchat/placement/native.py; called by streamchat/placement/lean_forward.py.

   out = weight * bf16(x * rsqrt(mean(x^2) + eps)), x widened to float32, the normalised row rounded to
   bfloat16 before the weight's product (rounded again): transformers' operations in transformers' dtypes.
   Eager torch runs those as nine calls of a few microseconds each, 61 norms a decode step of the
   default model. dim a multiple of 16. */
#include <math.h>

#include "kernels.h"
#include "vectors.h"

void rms_norm(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = x + r * dim;
        floats16 squares = zeros_16();
        for (int64_t i = 0; i < dim; i += 16) {
            floats16 v = load_16(row, 1, i);
            squares = fmadd_16(v, v, squares);
        }
        floats16 inverse = splat_16(1.0f / sqrtf(sum_16(squares) / (float)dim + eps));
        for (int64_t i = 0; i < dim; i += 16) {
            floats16 rounded = widen_16(narrow_16(mul_16(load_16(row, 1, i), inverse)));
            store_bf16_16(out + r * dim + i, mul_16(load_16(weight, 1, i), rounded));
        }
    }
}
