/* int8 weights (one scale per output row) times a few activation rows on AVX-512 VNNI CPUs: the output head
   (int8_rows_avx2.c on CPUs without AVX-512).

   Built and loaded by streamchat/placement/native.py; packed by streamchat/placement/native_layers.py.

   out[rows, n] (float32) = x[rows, k] @ (scale[o] * W[o, i]).T, W int8. Each activation row is split
   into two int8 parts over the whole row, a = step_a * (a1 + a2 / RESIDUAL_SCALE), about 16 bits of each
   value. VNNI multiplies unsigned bytes by signed ones, so each part goes in shifted by 128 (a1 + 128 is
   0..255) and 128 * sum_i W[o, i] comes off after. Weights are packed in tiles of 16 outputs, a vector
   holding 4 inputs of each: packed [n / 16, k / 4, 16, 4]; each tile is read once for up to ROW_BLOCK rows
   (aten's int8 kernel widens every weight to float32 and rereads them every 4 rows). */
#if defined(__AVX512F__)
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "vectors.h"

#define TILE 16
#define ROW_BLOCK 8
#define RESIDUAL_SCALE 254.0f

/* A row's two parts, shifted to unsigned bytes; returns the row's step. k a multiple of 16. */
static float split_row(const void *x, int x_bf16, int64_t k, int64_t at, uint8_t *levels, uint8_t *residuals) {
    __m512 largest = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) largest = _mm512_max_ps(largest, _mm512_abs_ps(load_16(x, x_bf16, at + i)));
    float step = _mm512_reduce_max_ps(largest) / 127.0f;
    const __m512 inverse = _mm512_set1_ps(step > 0.0f ? 1.0f / step : 0.0f), residual_scale = _mm512_set1_ps(RESIDUAL_SCALE);
    const __m512i shift = _mm512_set1_epi32(128);
    for (int64_t i = 0; i < k; i += 16) {
        __m512 scaled = _mm512_mul_ps(load_16(x, x_bf16, at + i), inverse);
        __m512 rounded = _mm512_roundscale_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512i rest = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(scaled, rounded), residual_scale));
        _mm_storeu_si128((__m128i *)(levels + i), _mm512_cvtusepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(rounded), shift)));
        _mm_storeu_si128((__m128i *)(residuals + i), _mm512_cvtusepi32_epi8(_mm512_add_epi32(rest, shift)));
    }
    return step;
}

static inline __attribute__((always_inline)) void tile_rows(const int rows, int64_t k, const int8_t *packed,
                                                            const uint8_t *levels, const uint8_t *residuals,
                                                            __m512i *dots, __m512i *rest_dots) {
    for (int r = 0; r < rows; r++) dots[r] = rest_dots[r] = _mm512_setzero_si512();
    for (int64_t quad = 0; quad < k / 4; quad++) {
        __m512i weights = _mm512_loadu_si512((const void *)(packed + quad * 64));
        for (int r = 0; r < rows; r++) {
            int32_t four, rest_four;
            memcpy(&four, levels + r * k + 4 * quad, sizeof four);
            memcpy(&rest_four, residuals + r * k + 4 * quad, sizeof rest_four);
            dots[r] = _mm512_dpbusd_epi32(dots[r], _mm512_set1_epi32(four), weights);
            rest_dots[r] = _mm512_dpbusd_epi32(rest_dots[r], _mm512_set1_epi32(rest_four), weights);
        }
    }
}

typedef void (*tile_function)(int64_t, const int8_t *, const uint8_t *, const uint8_t *, __m512i *, __m512i *);
#define TILE_ROWS(n)                                                                                             \
    static void tile_rows_##n(int64_t k, const int8_t *packed, const uint8_t *levels, const uint8_t *residuals, \
                              __m512i *dots, __m512i *rest_dots) {                                               \
        tile_rows(n, k, packed, levels, residuals, dots, rest_dots);                                             \
    }
TILE_ROWS(1) TILE_ROWS(2) TILE_ROWS(3) TILE_ROWS(4) TILE_ROWS(5) TILE_ROWS(6) TILE_ROWS(7) TILE_ROWS(8)
static const tile_function TILE_ROWS_OF[ROW_BLOCK + 1] = {
    0, tile_rows_1, tile_rows_2, tile_rows_3, tile_rows_4, tile_rows_5, tile_rows_6, tile_rows_7, tile_rows_8};

/* x [rows, k] (bfloat16 if x_bf16, else float32) @ (scales * W).T -> out [rows, n] float32; weight_sums[o] =
   sum_i W[o, i] (int32). k a multiple of 16, n of 16. Returns 0, or 1 when scratch memory could not be had. */
int int8_rows(const void *x, int x_bf16, int64_t rows, int64_t k, const int8_t *packed, const float *scales,
              const int32_t *weight_sums, int64_t n, float *out, int threads) {
    if (rows == 0) return 0;
    uint8_t *levels = malloc(2 * rows * k), *residuals = levels + rows * k;
    float *steps = malloc(sizeof(float) * rows);
    if (!levels || !steps) {
        free(levels), free(steps);
        return 1;
    }
    for (int64_t r = 0; r < rows; r++) steps[r] = split_row(x, x_bf16, k, r * k, levels + r * k, residuals + r * k);
    const int64_t tiles = n / TILE;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        __m512i dots[ROW_BLOCK], rest_dots[ROW_BLOCK];
        const __m512 scale = _mm512_loadu_ps(scales + t * TILE);
        const __m512i shifted = _mm512_slli_epi32(_mm512_loadu_si512((const void *)(weight_sums + t * TILE)), 7);
        for (int64_t first = 0; first < rows; first += ROW_BLOCK) {
            int block = rows - first < ROW_BLOCK ? (int)(rows - first) : ROW_BLOCK;
            TILE_ROWS_OF[block](k, packed + t * k * TILE, levels + first * k, residuals + first * k, dots, rest_dots);
            for (int r = 0; r < block; r++) {
                __m512 whole = _mm512_cvtepi32_ps(_mm512_sub_epi32(dots[r], shifted));
                __m512 rest = _mm512_cvtepi32_ps(_mm512_sub_epi32(rest_dots[r], shifted));
                __m512 sum = _mm512_fmadd_ps(rest, _mm512_set1_ps(1.0f / RESIDUAL_SCALE), whole);
                _mm512_storeu_ps(out + (first + r) * n + t * TILE,
                                 _mm512_mul_ps(sum, _mm512_mul_ps(scale, _mm512_set1_ps(steps[first + r]))));
            }
        }
    }
    free(levels), free(steps);
    return 0;
}
#endif
