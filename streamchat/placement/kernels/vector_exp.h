/* e^x of 16 floats at a time, for the kernels that need it (attention's softmax, SiLU). */
#ifndef STREAMCHAT_VECTOR_EXP_H
#define STREAMCHAT_VECTOR_EXP_H

#include "vectors.h"

/* e^x for x <= 0 (scores minus their maximum), 0 below -87: Cephes' expf, 16 at a time. */
static inline floats16 exp_16(floats16 x) {
    const floats16 original = x;
    x = max_16(x, splat_16(-87.0f));
    floats16 n = round_16(mul_16(x, splat_16(1.44269504088896341f)));
    floats16 r = fnmadd_16(n, splat_16(0.693359375f), x);
    r = fnmadd_16(n, splat_16(-2.12194440e-4f), r);
    floats16 p = splat_16(1.9875691500e-4f);
    p = fmadd_16(p, r, splat_16(1.3981999507e-3f));
    p = fmadd_16(p, r, splat_16(8.3334519073e-3f));
    p = fmadd_16(p, r, splat_16(4.1665795894e-2f));
    p = fmadd_16(p, r, splat_16(1.6666665459e-1f));
    p = fmadd_16(p, r, splat_16(5.0000001201e-1f));
    p = fmadd_16(p, mul_16(r, r), add_16(r, splat_16(1.0f)));
    return zero_below_16(original, scale_by_power_of_two_16(p, n), -87.0f);
}

#endif
