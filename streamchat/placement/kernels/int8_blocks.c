/* int8 weights in blocks of 32 inputs, each block with its own float16 scale (GGUF Q8_0's layout), times a few
   activation rows: the decoder's int8 layers.

   Built and loaded by streamchat/placement/native.py; packed by streamchat/placement/native_layers.py.

   out[rows, n] = x[rows, k] @ W.T, W[o, i] = scale[o, i / 32] * q[o, i], q int8. The levels are packed in
   int8_rows.c's tiles, q [n / 16, k / 4, 16, 4] (a vector holds 4 inputs of 16 outputs), the scales
   [n / 16, k / 32, 16]. As in int8_rows_avx2.c, each activation row is quantized once to int16 (one step a
   row, |a16| <= 32767: about 16 bits of each value, so no rounding worth a perplexity figure), each weight
   widened to int16 as it is read and the products summed by pairs in int32 over a block (32 x 127 x 32767
   fits); a block's 16 sums are widened to float32 and multiplied by its 16 scales. Each tile is read once for
   up to ROW_BLOCK rows. Written with AVX2 intrinsics alone: the AVX-512 build runs the same code. */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "bfloat16.h"
#include "kernels.h"

#define TILE 16
#define BLOCK 32
#define BLOCK_QUADS (BLOCK / 4)
#define ROW_BLOCK 4
#define LEVELS 32767.0f

static inline __m256 load_8(const void *x, int bf16, int64_t at) {
    if (!bf16) return _mm256_loadu_ps((const float *)x + at);
    __m128i half = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + at));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

/* A row as int16 levels; returns its step. k a multiple of 16. */
static float quantize_row(const void *x, int bf16, int64_t k, int64_t at, int16_t *levels) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 largest = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8) largest = _mm256_max_ps(largest, _mm256_and_ps(load_8(x, bf16, at + i), magnitude));
    __m128 four = _mm_max_ps(_mm256_castps256_ps128(largest), _mm256_extractf128_ps(largest, 1));
    four = _mm_max_ps(four, _mm_movehl_ps(four, four));
    float step = _mm_cvtss_f32(_mm_max_ss(four, _mm_movehdup_ps(four))) / LEVELS;
    const __m256 inverse = _mm256_set1_ps(step > 0.0f ? 1.0f / step : 0.0f);
    for (int64_t i = 0; i < k; i += 16) {
        __m256i low = _mm256_cvtps_epi32(_mm256_mul_ps(load_8(x, bf16, at + i), inverse));
        __m256i high = _mm256_cvtps_epi32(_mm256_mul_ps(load_8(x, bf16, at + i + 8), inverse));
        /* packs works within 128-bit lanes (low 0-3, high 0-3 | low 4-7, high 4-7): the permute restores order */
        __m256i both = _mm256_permute4x64_epi64(_mm256_packs_epi32(low, high), 0xD8);
        _mm256_storeu_si256((__m256i *)(levels + i), both);
    }
    return step;
}

/* Eight outputs' sums from two quarters' pair sums: quarter q holds outputs 4 q .. 4 q + 3, two int32 each. */
static inline __m256 outputs_8(__m256i first, __m256i second) {
    return _mm256_cvtepi32_ps(_mm256_permute4x64_epi64(_mm256_hadd_epi32(first, second), 0xD8));
}

/* One tile's 16 outputs for `rows` (<= ROW_BLOCK) rows: sums[2 r], sums[2 r + 1] its outputs 0-7 and 8-15. */
static inline __attribute__((always_inline)) void tile_rows(const int rows, int64_t k, const int8_t *packed,
                                                            const uint16_t *scales, const int16_t *levels,
                                                            __m256 *sums) {
    for (int r = 0; r < 2 * rows; r++) sums[r] = _mm256_setzero_ps();
    for (int64_t block = 0; block < k / BLOCK; block++) {
        __m256i pairs[ROW_BLOCK][4];
        for (int r = 0; r < rows; r++)
            for (int q = 0; q < 4; q++) pairs[r][q] = _mm256_setzero_si256();
        for (int64_t quad = block * BLOCK_QUADS; quad < (block + 1) * BLOCK_QUADS; quad++) {
            __m256i weights[4]; /* outputs 4 q .. 4 q + 3, their 4 inputs each, widened to int16 */
            for (int q = 0; q < 4; q++)
                weights[q] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(packed + quad * 64 + 16 * q)));
            for (int r = 0; r < rows; r++) {
                int64_t four;
                memcpy(&four, levels + r * k + 4 * quad, sizeof four);
                const __m256i inputs = _mm256_set1_epi64x(four);
                for (int q = 0; q < 4; q++)
                    pairs[r][q] = _mm256_add_epi32(pairs[r][q], _mm256_madd_epi16(weights[q], inputs));
            }
        }
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
static const tile_function TILE_ROWS_OF[ROW_BLOCK + 1] = {0, tile_rows_1, tile_rows_2, tile_rows_3, tile_rows_4};

/* x [rows, k] (bfloat16 if x_bf16, else float32) @ W.T -> out [rows, n] (bfloat16 if out_bf16, else float32).
   k a multiple of 32, n of 16. Returns 0, or 1 when scratch memory could not be had. */
int int8_blocks(const void *x, int x_bf16, int64_t rows, int64_t k, const int8_t *packed, const uint16_t *scales,
                int64_t n, void *out, int out_bf16, int threads) {
    if (rows == 0) return 0;
    int16_t *levels = malloc(sizeof(int16_t) * rows * k);
    float *steps = malloc(sizeof(float) * rows);
    if (!levels || !steps) {
        free(levels), free(steps);
        return 1;
    }
    for (int64_t r = 0; r < rows; r++) steps[r] = quantize_row(x, x_bf16, k, r * k, levels + r * k);
    const int64_t tiles = n / TILE, blocks = k / BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        __m256 sums[2 * ROW_BLOCK];
        float result[TILE];
        for (int64_t first = 0; first < rows; first += ROW_BLOCK) {
            int block = rows - first < ROW_BLOCK ? (int)(rows - first) : ROW_BLOCK;
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
