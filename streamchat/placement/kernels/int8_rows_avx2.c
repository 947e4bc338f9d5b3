/* int8 weights (one scale per output row) times a few activation rows on CPUs without AVX-512: the output
   head, as int8_rows.c computes it there.

   Built and loaded by streamchat/placement/native.py; packed by streamchat/placement/native_layers.py.

   out[rows, n] (float32) = x[rows, k] @ (scale[o] * W[o, i]).T, W int8, in the same packed tiles
   [n / 16, k / 4, 16, 4]. AVX2 has no unsigned-by-signed byte product that cannot overflow for int8
   weights (VNNI's), so each activation row is quantized once to int16 (a = step_a * a16, |a16| <= 32767:
   about the 16 bits int8_rows.c's two parts keep), each weight widened to int16 as it is read, and the
   products summed in int32 by pairs (one multiply-add per 16 weights, no second pass). A block of
   FLUSH_QUADS quads is summed in int32 (64 x 4 x 2 x 127 x 32767 fits), then added up in float32. */
#if !defined(__AVX512F__)
#include <stdlib.h>

#include "int16_rows.h"
#include "kernels.h"
#include "vectors.h"

#define TILE 16
#define FLUSH_QUADS 64

/* One tile's 16 outputs for `rows` (<= INT16_ROW_BLOCK) rows; `rows` is a constant where this is inlined. */
static inline __attribute__((always_inline)) void tile_rows(const int rows, int64_t k, const int8_t *packed,
                                                            const int16_t *levels, floats16 *sums) {
    for (int r = 0; r < rows; r++) sums[r] = zeros_16();
    for (int64_t first = 0; first < k / 4; first += FLUSH_QUADS) {
        const int64_t last = first + FLUSH_QUADS < k / 4 ? first + FLUSH_QUADS : k / 4;
        __m256i pairs[INT16_ROW_BLOCK][4];
        for (int r = 0; r < rows; r++)
            for (int q = 0; q < 4; q++) pairs[r][q] = _mm256_setzero_si256();
        add_quads(rows, packed, levels, k, first, last, pairs);
        for (int r = 0; r < rows; r++) {
            sums[r].low = _mm256_add_ps(sums[r].low, outputs_8(pairs[r][0], pairs[r][1]));
            sums[r].high = _mm256_add_ps(sums[r].high, outputs_8(pairs[r][2], pairs[r][3]));
        }
    }
}

typedef void (*tile_function)(int64_t, const int8_t *, const int16_t *, floats16 *);
#define TILE_ROWS(n)                                                                                  \
    static void tile_rows_##n(int64_t k, const int8_t *packed, const int16_t *levels, floats16 *sums) { \
        tile_rows(n, k, packed, levels, sums);                                                        \
    }
TILE_ROWS(1) TILE_ROWS(2) TILE_ROWS(3) TILE_ROWS(4)
static const tile_function TILE_ROWS_OF[INT16_ROW_BLOCK + 1] = {0, tile_rows_1, tile_rows_2, tile_rows_3, tile_rows_4};

/* As int8_rows.c's: weight_sums is not needed here. */
int int8_rows(const void *x, int x_bf16, int64_t rows, int64_t k, const int8_t *packed, const float *scales,
              const int32_t *weight_sums, int64_t n, float *out, int threads) {
    (void)weight_sums;
    if (rows == 0) return 0;
    int16_t *levels;
    float *steps;
    if (int16_rows(x, x_bf16, rows, k, &levels, &steps)) return 1;
    const int64_t tiles = n / TILE;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        floats16 sums[INT16_ROW_BLOCK];
        const floats16 scale = loadu_16(scales + t * TILE);
        for (int64_t first = 0; first < rows; first += INT16_ROW_BLOCK) {
            int block = rows - first < INT16_ROW_BLOCK ? (int)(rows - first) : INT16_ROW_BLOCK;
            TILE_ROWS_OF[block](k, packed + t * k * TILE, levels + first * k, sums);
            for (int r = 0; r < block; r++)
                storeu_16(out + (first + r) * n + t * TILE, mul_16(sums[r], mul_16(scale, splat_16(steps[first + r]))));
        }
    }
    free(levels), free(steps);
    return 0;
}
#endif
