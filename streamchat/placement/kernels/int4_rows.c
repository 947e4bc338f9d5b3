/* int4 weights times a few activation rows: streamchat's own product kernel.

   Built and loaded by streamchat/placement/native.py; packed by streamchat/placement/native_layers.py.

   out[rows, n] = x[rows, k] @ W.T, W[o, i] = q * step + minimum per group of 32 inputs (q in 0..15,
   step and minimum in float16: GGUF Q4_1's scheme). Each activation row is split per group of 32 into
   two int8 parts, a = step_a * (a1 + a2 / RESIDUAL_SCALE): a1 as llama.cpp's Q8 blocks (absmax / 127),
   a2 what a1 rounded off, so the pair keeps about 16 bits of each value (a1 alone lost 1 % of the
   default model's perplexity). A group's sum is step_w * step_a * (q . a1 + q . a2 / RESIDUAL_SCALE) +
   minimum * sum(a): AVX-512 VNNI multiplies 64 unsigned levels by 64 signed bytes in one instruction
   (AVX2 32 in one, summed in int16 over the group: vectors_avx2.h's group_dots_16).

   Weights are packed in tiles of 16 outputs, so that a vector's 16 lanes are 16 outputs and no sum
   needs a horizontal reduction: nibbles [n / 16, k / 32, 256] where byte 64 p + 4 o + j of a group holds
   input 8 p + j of output o in its low nibble and input 8 p + 4 + j in its high one; params [n / 16,
   k / 32, 2, 16] the outputs' steps, then their minimums. Each tile's weights are read once for up to
   INT4_ROW_BLOCK rows (8 on AVX-512; 2 on AVX2, the next 2 rereading the tile from the CPU's cache; aten's
   int4 kernel rereads them every 4), and the tiles are split over OpenMP threads: linked to libgomp, the
   same runtime (and so the same thread pool) as torch's. */
#include <stdlib.h>

#include "bfloat16.h"
#include "kernels.h"
#include "vectors.h"

#define TILE 16
#define GROUP 32
#define GROUP_BYTES 256 /* a tile's group: 16 outputs x 32 inputs, two to a byte */
#define MAX_ROW_BLOCK 8 /* the most rows a pass takes (vectors.h's INT4_ROW_BLOCK) */
#define RESIDUAL_SCALE 254.0f /* what a1 rounded off, within +-0.5, times this fits an int8 */

static inline void store_levels(int8_t *at, floats16 scaled, floats16 residual_scale, int8_t *residuals) {
    floats16 rounded = round_16(scaled);
    store_int8_16(at, rounded);
    store_int8_16(residuals, mul_16(sub_16(scaled, rounded), residual_scale));
}

/* Each row's groups as int8 levels and residuals, each group's step and the exact sum of its values. */
static void quantize_rows(const void *x, int x_bf16, int64_t rows, int64_t k, int8_t *levels, int8_t *residuals,
                          float *steps, float *sums) {
    const floats16 residual_scale = splat_16(RESIDUAL_SCALE);
    int64_t groups = k / GROUP;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t g = 0; g < groups; g++) {
            int64_t at = r * k + g * GROUP;
            floats16 low = load_16(x, x_bf16, at), high = load_16(x, x_bf16, at + 16);
            float largest = largest_16(max_16(abs_16(low), abs_16(high)));
            float step = largest / 127.0f;
            floats16 inverse = splat_16(step > 0.0f ? 1.0f / step : 0.0f);
            store_levels(levels + at, mul_16(low, inverse), residual_scale, residuals + at);
            store_levels(levels + at + 16, mul_16(high, inverse), residual_scale, residuals + at + 16);
            steps[r * groups + g] = step;
            sums[r * groups + g] = sum_16(add_16(low, high));
        }
    }
}

/* One tile's 16 outputs for `rows` (<= INT4_ROW_BLOCK) rows; `rows` is a constant where this is inlined. */
static inline __attribute__((always_inline)) void tile_rows(const int rows, int64_t groups, const uint8_t *nibbles,
                                                            const uint16_t *params, const int8_t *levels,
                                                            const int8_t *residuals, const float *steps,
                                                            const float *sums, int64_t k, float *result) {
    floats16 sum[MAX_ROW_BLOCK];
    for (int r = 0; r < rows; r++) sum[r] = zeros_16();
    const floats16 residual_part = splat_16(1.0f / RESIDUAL_SCALE);
    for (int64_t g = 0; g < groups; g++) {
        ints16 dot[MAX_ROW_BLOCK], rest_dot[MAX_ROW_BLOCK];
        group_dots_16(rows, nibbles + g * GROUP_BYTES, levels + g * GROUP, residuals + g * GROUP, k, dot, rest_dot);
        floats16 step = widen_half_16(params + g * 2 * TILE);
        floats16 minimum = widen_half_16(params + g * 2 * TILE + TILE);
        for (int r = 0; r < rows; r++) {
            floats16 scale = mul_16(step, splat_16(steps[r * groups + g]));
            sum[r] = fmadd_16(int_to_floats_16(dot[r]), scale, sum[r]);
            sum[r] = fmadd_16(int_to_floats_16(rest_dot[r]), mul_16(scale, residual_part), sum[r]);
            sum[r] = fmadd_16(minimum, splat_16(sums[r * groups + g]), sum[r]);
        }
    }
    for (int r = 0; r < rows; r++) storeu_16(result + r * TILE, sum[r]);
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
static const tile_function TILE_ROWS_OF[MAX_ROW_BLOCK + 1] = {
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
        float result[MAX_ROW_BLOCK * TILE];
        for (int64_t first = 0; first < rows; first += INT4_ROW_BLOCK) {
            int block = rows - first < INT4_ROW_BLOCK ? (int)(rows - first) : INT4_ROW_BLOCK;
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
