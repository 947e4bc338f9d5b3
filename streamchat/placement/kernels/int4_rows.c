/* int4 weights times a few activation rows on AVX-512 VNNI CPUs: streamchat's own product kernel.

   Built and loaded by streamchat/placement/native.py; packed by streamchat/placement/native_layers.py.

   out[rows, n] = x[rows, k] @ W.T, W[o, i] = q * step + minimum per group of 32 inputs (q in 0..15,
   step and minimum in float16: GGUF Q4_1's scheme). Each activation row is split per group of 32 into
   two int8 parts, a = step_a * (a1 + a2 / RESIDUAL_SCALE): a1 as llama.cpp's Q8 blocks (absmax / 127),
   a2 what a1 rounded off, so the pair keeps about 16 bits of each value (a1 alone lost 1 % of the
   default model's perplexity). A group's sum is step_w * step_a * (q . a1 + q . a2 / RESIDUAL_SCALE) +
   minimum * sum(a): VNNI multiplies 64 unsigned levels by 64 signed bytes in one instruction.

   Weights are packed in tiles of 16 outputs, so that a vector's 16 lanes are 16 outputs and no sum
   needs a horizontal reduction: nibbles [n / 16, k / 32, 256] where byte 64 p + 4 o + j of a group holds
   input 8 p + j of output o in its low nibble and input 8 p + 4 + j in its high one; params [n / 16,
   k / 32, 2, 16] the outputs' steps, then their minimums. Each tile's weights are read once for up to
   ROW_BLOCK rows (aten's int4 kernel rereads them every 4), and the tiles are split over OpenMP threads:
   linked to libgomp, the same runtime (and so the same thread pool) as torch's. */
#include <stdlib.h>

#include "bfloat16.h"
#include "kernels.h"

#define TILE 16
#define GROUP 32
#define GROUP_BYTES 256 /* a tile's group: 16 outputs x 32 inputs, two to a byte */
#define ROW_BLOCK 8     /* rows one pass over a tile computes: 8 accumulators, 8 weight vectors, in registers */
#define RESIDUAL_SCALE 254.0f /* what a1 rounded off, within +-0.5, times this fits an int8 */

static inline void store_levels(int8_t *at, __m512 scaled, __m512 residual_scale, int8_t *residuals) {
    __m512 rounded = _mm512_roundscale_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128((__m128i *)at, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(rounded)));
    __m512 rest = _mm512_mul_ps(_mm512_sub_ps(scaled, rounded), residual_scale);
    _mm_storeu_si128((__m128i *)residuals, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(rest)));
}

/* Each row's groups as int8 levels and residuals, each group's step and the exact sum of its values. */
static void quantize_rows(const void *x, int x_bf16, int64_t rows, int64_t k, int8_t *levels, int8_t *residuals,
                          float *steps, float *sums) {
    const __m512 residual_scale = _mm512_set1_ps(RESIDUAL_SCALE);
    int64_t groups = k / GROUP;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t g = 0; g < groups; g++) {
            int64_t at = r * k + g * GROUP;
            __m512 low = load_16(x, x_bf16, at), high = load_16(x, x_bf16, at + 16);
            float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high)));
            float step = largest / 127.0f;
            __m512 inverse = _mm512_set1_ps(step > 0.0f ? 1.0f / step : 0.0f);
            store_levels(levels + at, _mm512_mul_ps(low, inverse), residual_scale, residuals + at);
            store_levels(levels + at + 16, _mm512_mul_ps(high, inverse), residual_scale, residuals + at + 16);
            steps[r * groups + g] = step;
            sums[r * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(low, high));
        }
    }
}

/* One tile's 16 outputs for `rows` (<= ROW_BLOCK) rows; `rows` is a constant where this is inlined. */
static inline __attribute__((always_inline)) void tile_rows(const int rows, int64_t groups, const uint8_t *nibbles,
                                                            const uint16_t *params, const int8_t *levels,
                                                            const int8_t *residuals, const float *steps,
                                                            const float *sums, int64_t k, float *result) {
    __m512 sum[ROW_BLOCK];
    for (int r = 0; r < rows; r++) sum[r] = _mm512_setzero_ps();
    const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
    const __m512 residual_part = _mm512_set1_ps(1.0f / RESIDUAL_SCALE);
    for (int64_t g = 0; g < groups; g++) {
        __m512i weights[8]; /* inputs 4 j .. 4 j + 3 of the group, for the 16 outputs */
        for (int p = 0; p < 4; p++) {
            __m512i packed = _mm512_loadu_si512((const void *)(nibbles + g * GROUP_BYTES + 64 * p));
            weights[2 * p] = _mm512_and_si512(packed, low_nibbles);
            weights[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles);
        }
        __m512 step = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(params + g * 2 * TILE)));
        __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(params + g * 2 * TILE + TILE)));
        for (int r = 0; r < rows; r++) {
            const int8_t *row = levels + r * k + g * GROUP, *rest = residuals + r * k + g * GROUP;
            __m512i dot = _mm512_setzero_si512(), rest_dot = _mm512_setzero_si512();
            for (int j = 0; j < 8; j++) {
                int32_t four, rest_four;
                memcpy(&four, row + 4 * j, sizeof four);
                memcpy(&rest_four, rest + 4 * j, sizeof rest_four);
                dot = _mm512_dpbusd_epi32(dot, weights[j], _mm512_set1_epi32(four));
                rest_dot = _mm512_dpbusd_epi32(rest_dot, weights[j], _mm512_set1_epi32(rest_four));
            }
            __m512 scale = _mm512_mul_ps(step, _mm512_set1_ps(steps[r * groups + g]));
            sum[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, sum[r]);
            sum[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(rest_dot), _mm512_mul_ps(scale, residual_part), sum[r]);
            sum[r] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(sums[r * groups + g]), sum[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(result + r * TILE, sum[r]);
}

typedef void (*tile_function)(int64_t, const uint8_t *, const uint16_t *, const int8_t *, const int8_t *,
                              const float *, const float *, int64_t, float *);
#define TILE_ROWS(n)                                                                                          \
    static void tile_rows_##n(int64_t groups, const uint8_t *nibbles, const uint16_t *params,                 \
                              const int8_t *levels, const int8_t *residuals, const float *steps,              \
                              const float *sums, int64_t k, float *result) {                                  \
        tile_rows(n, groups, nibbles, params, levels, residuals, steps, sums, k, result);                     \
    }
TILE_ROWS(1) TILE_ROWS(2) TILE_ROWS(3) TILE_ROWS(4) TILE_ROWS(5) TILE_ROWS(6) TILE_ROWS(7) TILE_ROWS(8)
static const tile_function TILE_ROWS_OF[ROW_BLOCK + 1] = {
    0, tile_rows_1, tile_rows_2, tile_rows_3, tile_rows_4, tile_rows_5, tile_rows_6, tile_rows_7, tile_rows_8};

/* x [rows, k] (bfloat16 if x_bf16, else float32) @ W.T -> out [rows, n] (bfloat16 if out_bf16, else float32).
   k a multiple of 32, n of 16. Returns 0, or 1 when scratch memory could not be had. */
int int4_rows(const void *x, int x_bf16, int64_t rows, int64_t k, const uint8_t *nibbles, const uint16_t *params,
              int64_t n, void *out, int out_bf16, int threads) {
    if (rows == 0) return 0;
    int64_t groups = k / GROUP, tiles = n / TILE;
    int8_t *levels = malloc(2 * rows * k), *residuals = levels + rows * k;
    float *steps = malloc(sizeof(float) * rows * groups), *sums = malloc(sizeof(float) * rows * groups);
    if (!levels || !steps || !sums) {
        free(levels), free(steps), free(sums);
        return 1;
    }
    quantize_rows(x, x_bf16, rows, k, levels, residuals, steps, sums);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        float result[ROW_BLOCK * TILE];
        for (int64_t first = 0; first < rows; first += ROW_BLOCK) {
            int block = rows - first < ROW_BLOCK ? (int)(rows - first) : ROW_BLOCK;
            TILE_ROWS_OF[block](groups, nibbles + t * groups * GROUP_BYTES, params + t * groups * 2 * TILE,
                                levels + first * k, residuals + first * k, steps + first * groups,
                                sums + first * groups, k, result);
            for (int r = 0; r < block; r++) {
                int64_t at = (first + r) * n + t * TILE;
                if (out_bf16)
                    for (int o = 0; o < TILE; o++) ((uint16_t *)out)[at + o] = float_to_bf16(result[r * TILE + o]);
                else
                    memcpy((float *)out + at, result + r * TILE, TILE * sizeof(float));
            }
        }
    }
    free(levels), free(steps), free(sums);
    return 0;
}
