/* The vectors streamchat's kernels compute with, 16 float32 lanes (and the products' integer lanes), on the
   CPU the library is built for: one AVX-512 register each (vectors_avx512.h), or two AVX2 ones
   (vectors_avx2.h). The kernels are written once against these; placement/native.py builds them for each. */
#ifndef STREAMCHAT_VECTORS_H
#define STREAMCHAT_VECTORS_H

#if defined(__AVX512F__)
#include "vectors_avx512.h"
#else
#include "vectors_avx2.h"
#endif

/* 16 values from x[at], bfloat16 if bf16, else float32, as float32. */
static inline floats16 load_16(const void *x, int bf16, int64_t at) {
    if (!bf16) return loadu_16((const float *)x + at);
    return widen_16(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + at)));
}

/* 16 float32 values rounded to bfloat16, stored at `at`. */
static inline void store_bf16_16(uint16_t *at, floats16 x) { _mm256_storeu_si256((__m256i *)at, narrow_16(x)); }

#endif
