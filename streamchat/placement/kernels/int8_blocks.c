/* int8 weights in blocks of 32 inputs, each block with its own float16 scale (GGUF Q8_0's layout), times a few
   activation rows: the decoder's int8 layers.

   Built and loaded by streamchat/placement/native.py; packed by streamchat/placement/native_layers.py.

   out[rows, n] = x[rows, k] @ W.T, W[o, i] = scale[o, i / 32] * q[o, i], q int8. The levels are packed in
   int8_rows.c's tiles, q [n / 16, k / 4, 16, 4] (a vector holds 4 inputs of 16 outputs), the scales
   [n / 16, k / 32, 16]. As in int8_rows_avx2.c, each activation row is quantized once to int16 (one step a
   row, |a16| <= 32767: about 16 bits of each value, so no rounding worth a perplexity figure), each weight
   widened to int16 as it is read and the products summed by pairs in int32 over a block (32 x 127 x 32767
   fits); a block's 16 sums are widened to float32 and multiplied by its 16 scales. Each tile is read once for
   up to INT16_ROW_BLOCK rows (int16_rows.h). Written with AVX2 intrinsics alone: the AVX-512 build runs them
   too. */
#include <stdlib.h>

#include "bfloat16.h"
#include "int16_rows.h"
#include "kernels.h"

#define TILE 16
#define BLOCK 32
#define BLOCK_QUADS (BLOCK / 4)

/* One tile's 16 outputs for `rows` (<= INT16_ROW_BLOCK) rows: sums[2 r], sums[2 r + 1] its outputs 0-7, 8-15. */
static inline __attribute__((always_inline)) void tile_rows(const int rows, int64_t k, const int8_t *packed,
                                                            const uint16_t *scales, const int16_t *levels,
                                                            __m256 *sums) {
    for (int r = 0; r < 2 * rows; r++) sums[r] = _mm256_setzero_ps();
    for (int64_t block = 0; block < k / BLOCK; block++) {
        __m256i pairs[INT16_ROW_BLOCK][4];
        for (int r = 0; r < rows; r++)
            for (int q = 0; q < 4; q++) pairs[r][q] = _mm256_setzero_si256();
        add_quads(rows, packed, levels, k, block * BLOCK_QUADS, (block + 1) * BLOCK_QUADS, pairs);
        const __m256 low = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + block * TILE)));
        const __m256 high = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + block * TILE + 8)));
        for (int r = 0; r < rows; r++) {
            sums[2 * r] = _mm256_fmadd_ps(outputs_8(pairs[r][0], pairs[r][1]), low, sums[2 * r]);
            sums[2 * r + 1] = _mm256_fmadd_ps(outputs_8(pairs[r][2], pairs[r][3]), high, sums[2 * r + 1]);
        }
    }
}

typedef void (*tile_function)(int64_t, const int8_t *, const uint16_t *, const int16_t *, __m256 *);
#define TILE_ROWS(n)                                                                                           \
    static void tile_rows_##n(int64_t k, const int8_t *packed, const uint16_t *scales, const int16_t *levels, \
                              __m256 *sums) {                                                                  \
        tile_rows(n, k, packed, scales, levels, sums);                                                         \
    }
TILE_ROWS(1) TILE_ROWS(2) TILE_ROWS(3) TILE_ROWS(4)
static const tile_function TILE_ROWS_OF[INT16_ROW_BLOCK + 1] = {0, tile_rows_1, tile_rows_2, tile_rows_3, tile_rows_4};

/* x [rows, k] (bfloat16 if x_bf16, else float32) @ W.T -> out [rows, n] (bfloat16 if out_bf16, else float32).
   k a multiple of 32, n of 16. Returns 0, or 1 when scratch memory could not be had. */
int int8_blocks(const void *x, int x_bf16, int64_t rows, int64_t k, const int8_t *packed, const uint16_t *scales,
                int64_t n, void *out, int out_bf16, int threads) {
    if (rows == 0) return 0;
    int16_t *levels;
    float *steps;
    if (int16_rows(x, x_bf16, rows, k, &levels, &steps)) return 1;
    const int64_t tiles = n / TILE, blocks = k / BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        __m256 sums[2 * INT16_ROW_BLOCK];
        float result[TILE];
        for (int64_t first = 0; first < rows; first += INT16_ROW_BLOCK) {
            int block = rows - first < INT16_ROW_BLOCK ? (int)(rows - first) : INT16_ROW_BLOCK;
            TILE_ROWS_OF[block](k, packed + t * k * TILE, scales + t * blocks * TILE, levels + first * k, sums);
            for (int r = 0; r < block; r++) {
                const __m256 step = _mm256_set1_ps(steps[first + r]);
                _mm256_storeu_ps(result, _mm256_mul_ps(sums[2 * r], step));
                _mm256_storeu_ps(result + 8, _mm256_mul_ps(sums[2 * r + 1], step));
                int64_t at = (first + r) * n + t * TILE;
                if (out_bf16)
                    for (int o = 0; o < TILE; o++) ((uint16_t *)out)[at + o] = float_to_bf16(result[o]);
                else
                    memcpy((float *)out + at, result, sizeof result);
            }
        }
    }
    free(levels), free(steps);
    return 0;
}
