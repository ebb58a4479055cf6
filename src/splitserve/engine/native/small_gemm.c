/* out[M, N] = x[M, K] @ W[K, N] for the row counts of decode steps, W packed as [N/8][K][8].
 *
 * Decode with a few running sequences is bound by streaming the weights from memory;
 * MKL's sgemm reads them about twice for 2 <= M <= 8 here, and reaches ~40% of this
 * kernel's rate for 16-64 rows. Each packed weight tile (8 output columns) is read
 * contiguously and, for every group of up to 8 rows, multiplied into M x 8 accumulators
 * held in registers; a later group finds the tile in cache. Tiles are shared out over
 * the threads.
 *
 * NOTE: the rows are copied k-major first ([K][rows] per group). Read row-major, a
 * group of 8 rows is 8 more concurrent streams beside the weights', and the weight
 * stream then ran at a third of the memory bandwidth (measured: 3.3 vs 1.4 ns per
 * k step at 8 rows).
 *
 * Every output element is one chain of FMAs over k = 0..K-1 in order, whatever M is, so a
 * row's result does not depend on the other rows of the batch. A software prefetch runs
 * ahead in the weight tile (measured: 8 rows on 2 threads, 14.1 vs 17.8 ms for the
 * model's weights).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define TILE 8
#define GROUP 8       /* rows per pass over a weight tile */
#define PREFETCH 128  /* k steps ahead in each weight tile */

/* MM rows of a group (xt: [K][MM]) times one weight tile: MM x 8 accumulators. */
#define KERNEL(MM)                                                                                   \
    static void tile_##MM(const float *xt, const float *w, int64_t K, float *out, int64_t ldo) {     \
        __m256 acc[MM];                                                                              \
        for (int m = 0; m < MM; m++) acc[m] = _mm256_setzero_ps();                                   \
        for (int64_t k = 0; k < K; k++) {                                                            \
            _mm_prefetch((const char *)(w + (k + PREFETCH) * TILE), _MM_HINT_T0);                   \
            const __m256 wk = _mm256_loadu_ps(w + k * TILE);                                         \
            for (int m = 0; m < MM; m++) acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(xt[k * MM + m]), wk, acc[m]); \
        }                                                                                            \
        for (int m = 0; m < MM; m++) _mm256_storeu_ps(out + m * ldo, acc[m]);                        \
    }

KERNEL(1)
KERNEL(2)
KERNEL(3)
KERNEL(4)
KERNEL(5)
KERNEL(6)
KERNEL(7)
KERNEL(8)

typedef void (*tile_fn)(const float *, const float *, int64_t, float *, int64_t);
static const tile_fn TILES[GROUP + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6, tile_7, tile_8};

/* x: [M, K]; wp: [N/8, K, 8]; out: [M, N] (N a multiple of 8).
 * Returns 0, -1 for a bad M or N, -2 when out of memory. */
int small_gemm(const float *x, const float *wp, int M, int64_t K, int64_t N, float *out, int nthreads) {
    if (M < 1 || N % TILE) return -1;
    float *xt = malloc(sizeof(float) * (size_t)M * (size_t)K); /* groups of GROUP rows, each [K][rows] */
    if (!xt) return -2;
    for (int g = 0; g < M; g += GROUP) {
        const int rows = M - g < GROUP ? M - g : GROUP;
        float *dst = xt + (int64_t)g * K;
        for (int m = 0; m < rows; m++)
            for (int64_t k = 0; k < K; k++) dst[k * rows + m] = x[(int64_t)(g + m) * K + k];
    }
    const int64_t tiles = N / TILE;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < tiles; t++)
        for (int g = 0; g < M; g += GROUP) {
            const int rows = M - g < GROUP ? M - g : GROUP;
            TILES[rows](xt + (int64_t)g * K, wp + t * K * TILE, K, out + (int64_t)g * N + t * TILE, N);
        }
    free(xt);
    return 0;
}
