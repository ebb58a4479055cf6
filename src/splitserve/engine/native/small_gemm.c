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

/* Q4 tiles: weights kept as 4-bit codes with a scale and an offset per block of QK k steps
 * and output column (GGUF's Q4_1), w = d * q + m, de-quantized in registers. d * q is exact
 * (an 11-bit fp16 scale times a 4-bit code), so one FMA gives the same float as the
 * multiply-then-add that produced the fp32 weights: every product and every sum is the one
 * the fp32 tile above computes, and so is the result. Reading 6 bits per weight instead
 * of 32 is what makes a step of a few rows faster; with more rows the FMAs bind instead.
 * Block layout (QBLOCK bytes): d[8], m[8] as float, then QK/2 pairs of k steps, 8 bytes
 * each: column c's code for the even k in the low nibble, the odd k's in the high one. */
#define QK 32
#define QBLOCK (16 * 4 + QK / 2 * TILE)

static inline void dequant_pair(const uint8_t *q, __m256 d, __m256 m, __m256 *w0, __m256 *w1) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
    const __m256i lo = _mm256_and_si256(b, _mm256_set1_epi32(15));
    const __m256i hi = _mm256_srli_epi32(b, 4);
    *w0 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(lo), m);
    *w1 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(hi), m);
}

/* MM rows times NT Q4 tiles side by side. With one row, one tile is one chain of dependent
 * FMAs (4 cycles each) and the step waits on that chain, not on memory; NT tiles give NT
 * independent chains. Each output element still sums over k in order. */
#define QKERNEL(MM, NT)                                                                              \
    static void qtile_##MM(const float *xt, const uint8_t *w, int64_t K, float *out, int64_t ldo,   \
                           int64_t tile_bytes) {                                                     \
        __m256 acc[MM][NT];                                                                          \
        for (int m = 0; m < MM; m++)                                                                 \
            for (int j = 0; j < NT; j++) acc[m][j] = _mm256_setzero_ps();                            \
        for (int64_t k0 = 0; k0 < K; k0 += QK, w += QBLOCK) {                                        \
            __m256 d[NT], mo[NT];                                                                    \
            for (int j = 0; j < NT; j++) {                                                           \
                const uint8_t *b = w + j * tile_bytes;                                               \
                _mm_prefetch((const char *)(b + 4 * QBLOCK), _MM_HINT_T0);                           \
                _mm_prefetch((const char *)(b + 4 * QBLOCK + 64), _MM_HINT_T0);                      \
                _mm_prefetch((const char *)(b + 4 * QBLOCK + 128), _MM_HINT_T0);                     \
                d[j] = _mm256_loadu_ps((const float *)b);                                            \
                mo[j] = _mm256_loadu_ps((const float *)b + 8);                                       \
            }                                                                                        \
            for (int64_t p = 0; p < QK / 2; p++) {                                                   \
                const int64_t k = k0 + 2 * p;                                                        \
                for (int j = 0; j < NT; j++) {                                                       \
                    __m256 w0, w1;                                                                   \
                    dequant_pair(w + j * tile_bytes + 64 + p * TILE, d[j], mo[j], &w0, &w1);         \
                    for (int m = 0; m < MM; m++)                                                     \
                        acc[m][j] = _mm256_fmadd_ps(_mm256_set1_ps(xt[k * MM + m]), w0, acc[m][j]);  \
                    for (int m = 0; m < MM; m++)                                                     \
                        acc[m][j] = _mm256_fmadd_ps(_mm256_set1_ps(xt[(k + 1) * MM + m]), w1, acc[m][j]); \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
        for (int m = 0; m < MM; m++)                                                                 \
            for (int j = 0; j < NT; j++) _mm256_storeu_ps(out + m * ldo + j * TILE, acc[m][j]);       \
    }

#define QNT 4    /* tiles per call of a Q4 kernel */
#define QMAX_M 4 /* more rows: the FMAs bind, and the fp32 tiles are faster */
QKERNEL(1, QNT)
QKERNEL(2, QNT)
QKERNEL(3, QNT)
QKERNEL(4, QNT)

typedef void (*qtile_fn)(const float *, const uint8_t *, int64_t, float *, int64_t, int64_t);
static const qtile_fn QTILES[QMAX_M + 1] = {0, qtile_1, qtile_2, qtile_3, qtile_4};

typedef void (*tile_fn)(const float *, const float *, int64_t, float *, int64_t);
static const tile_fn TILES[GROUP + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6, tile_7, tile_8};

/* The rows in groups of GROUP, each group k-major ([K][rows]); NULL when out of memory. */
static float *rows_k_major(const float *x, int M, int64_t K) {
    float *xt = malloc(sizeof(float) * (size_t)M * (size_t)K);
    if (!xt) return NULL;
    for (int g = 0; g < M; g += GROUP) {
        const int rows = M - g < GROUP ? M - g : GROUP;
        float *dst = xt + (int64_t)g * K;
        for (int m = 0; m < rows; m++)
            for (int64_t k = 0; k < K; k++) dst[k * rows + m] = x[(int64_t)(g + m) * K + k];
    }
    return xt;
}

/* x: [M, K] with M <= QMAX_M; wq: [N/8][K/QK] Q4 blocks; out: [M, N] (N a multiple of
 * 8 * QNT, K of QK). Returns 0, -1 for a bad M, K or N, -2 when out of memory. */
int small_gemm_q4(const float *x, const uint8_t *wq, int M, int64_t K, int64_t N, float *out, int nthreads) {
    if (M < 1 || M > QMAX_M || N % (TILE * QNT) || K % QK) return -1;
    float *xt = rows_k_major(x, M, K);
    if (!xt) return -2;
    const int64_t tile_bytes = K / QK * QBLOCK;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < N / TILE; t += QNT) QTILES[M](xt, wq + t * tile_bytes, K, out + t * TILE, N, tile_bytes);
    free(xt);
    return 0;
}

/* x: [M, K]; wp: [N/8, K, 8]; out: [M, N] (N a multiple of 8).
 * Returns 0, -1 for a bad M or N, -2 when out of memory. */
int small_gemm(const float *x, const float *wp, int M, int64_t K, int64_t N, float *out, int nthreads) {
    if (M < 1 || N % TILE) return -1;
    float *xt = rows_k_major(x, M, K);
    if (!xt) return -2;
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
