/* What streamchat's kernels share: activations read as float32 whatever they are stored in, results
   rounded back to bfloat16 as torch rounds them (to nearest, ties to even; NaN aside). One value at a
   time here; 16 at a time in vectors.h. */
#ifndef STREAMCHAT_BFLOAT16_H
#define STREAMCHAT_BFLOAT16_H

#include <stdint.h>
#include <string.h>

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

#endif
