/* out[M, N] = x[M, K] @ W[K, N] for small M (1..8), W packed as [N/8][K][8].
 *
 * Decode with a few running sequences is bound by streaming the weights from memory;
 * MKL's sgemm reads them about twice for 2 <= M <= 8 here. This kernel reads each
 * packed weight tile once, contiguously, and keeps the M x 8 accumulators in
 * registers. Tiles of 8 output columns are shared out over the threads.
 */
#include <immintrin.h>
#include <stdint.h>

#define TILE 8

#define KERNEL(MM)                                                                                   \
    static void tile_##MM(const float *x, const float *w, int64_t K, float *out, int64_t ldo) {      \
        __m256 acc[MM];                                                                              \
        for (int m = 0; m < MM; m++) acc[m] = _mm256_setzero_ps();                                   \
        for (int64_t k = 0; k < K; k++) {                                                            \
            const __m256 wk = _mm256_loadu_ps(w + k * TILE);                                         \
            for (int m = 0; m < MM; m++) acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(x[m * K + k]), wk, acc[m]); \
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
static const tile_fn TILES[9] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6, tile_7, tile_8};

/* x: [M, K]; wp: [N/8, K, 8]; out: [M, N] (N a multiple of 8). Returns 0, or -1 for a bad M. */
int small_gemm(const float *x, const float *wp, int M, int64_t K, int64_t N, float *out, int nthreads) {
    if (M < 1 || M > 8 || N % TILE) return -1;
    const tile_fn fn = TILES[M];
    const int64_t tiles = N / TILE;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < tiles; t++) fn(x, wp + t * K * TILE, K, out + t * TILE, N);
    return 0;
}
