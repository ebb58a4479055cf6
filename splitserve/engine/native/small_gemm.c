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

/* Quantized tiles: weights kept as integer codes with per-block scales (GGUF's blocks of
 * QK k steps of one output column), de-quantized in registers. Two formats:
 *   Q4_1: w = d * q + m, q in 0..15 (the model's projections);
 *   Q8_0: w = d * q, q in -128..127 (its lm_head).
 * d * q is exact (an 11-bit fp16 scale times a 4- or 8-bit code), so the de-quantized float
 * is the one that produced the fp32 weights: every product and every sum is the one the
 * fp32 tile above computes, and so is the result. Reading 6 or 9 bits per weight instead
 * of 32 is what makes a step of a few rows faster; with more rows the FMAs bind instead.
 * Block layouts, per tile of 8 columns and QK k steps (column c at lane c):
 *   Q4_1 (Q4_BLOCK bytes): d[8], m[8] as float, then QK/2 pairs of k steps, 8 bytes each:
 *        the even k's code in the low nibble, the odd k's in the high one;
 *   Q8_0 (Q8_BLOCK bytes): d[8] as float, then QK/2 pairs of k steps, 16 bytes each: the
 *        even k's 8 codes, then the odd k's. */
#define QK 32
#define Q4_HEAD 64
#define Q4_PAIR 8
#define Q4_BLOCK (Q4_HEAD + QK / 2 * Q4_PAIR)
#define Q8_HEAD 32
#define Q8_PAIR 16
#define Q8_BLOCK (Q8_HEAD + QK / 2 * Q8_PAIR)

static inline void Q4_head(const uint8_t *b, __m256 *d, __m256 *m) {
    *d = _mm256_loadu_ps((const float *)b);
    *m = _mm256_loadu_ps((const float *)b + 8);
}

static inline void Q4_pair(const uint8_t *q, __m256 d, __m256 m, __m256 *w0, __m256 *w1) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
    const __m256i lo = _mm256_and_si256(b, _mm256_set1_epi32(15));
    const __m256i hi = _mm256_srli_epi32(b, 4);
    *w0 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(lo), m);
    *w1 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(hi), m);
}

static inline void Q8_head(const uint8_t *b, __m256 *d, __m256 *m) {
    *d = _mm256_loadu_ps((const float *)b);
    *m = _mm256_setzero_ps(); /* unused */
}

static inline void Q8_pair(const uint8_t *q, __m256 d, __m256 m, __m256 *w0, __m256 *w1) {
    (void)m;
    const __m128i b = _mm_loadu_si128((const __m128i *)q);
    *w0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
    *w1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(b, b))));
}

/* MM rows times NT quantized tiles side by side. With one row, one tile is one chain of
 * dependent FMAs (4 cycles each) and the step waits on that chain, not on memory; NT
 * tiles give NT independent chains. Each output element still sums over k in order. */
#define QKERNEL(F, MM, NT)                                                                           \
    static void F##tile_##MM(const float *xt, const uint8_t *w, int64_t K, float *out, int64_t ldo, \
                             int64_t tile_bytes) {                                                   \
        __m256 acc[MM][NT];                                                                          \
        for (int m = 0; m < MM; m++)                                                                 \
            for (int j = 0; j < NT; j++) acc[m][j] = _mm256_setzero_ps();                            \
        for (int64_t k0 = 0; k0 < K; k0 += QK, w += F##_BLOCK) {                                     \
            __m256 d[NT], mo[NT];                                                                    \
            for (int j = 0; j < NT; j++) {                                                           \
                const uint8_t *b = w + j * tile_bytes;                                               \
                for (int o = 0; o < F##_BLOCK; o += 64)                                              \
                    _mm_prefetch((const char *)(b + 4 * F##_BLOCK + o), _MM_HINT_T0);                \
                F##_head(b, &d[j], &mo[j]);                                                          \
            }                                                                                        \
            for (int64_t p = 0; p < QK / 2; p++) {                                                   \
                const int64_t k = k0 + 2 * p;                                                        \
                for (int j = 0; j < NT; j++) {                                                       \
                    __m256 w0, w1;                                                                   \
                    F##_pair(w + j * tile_bytes + F##_HEAD + p * F##_PAIR, d[j], mo[j], &w0, &w1);  \
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

#define QNT 4    /* tiles per call of a quantized kernel */
#define QMAX_M 4 /* more rows: the FMAs bind, and the fp32 tiles are faster */
QKERNEL(Q4, 1, QNT)
QKERNEL(Q4, 2, QNT)
QKERNEL(Q4, 3, QNT)
QKERNEL(Q4, 4, QNT)
QKERNEL(Q8, 1, QNT)
QKERNEL(Q8, 2, QNT)
QKERNEL(Q8, 3, QNT)
QKERNEL(Q8, 4, QNT)

typedef void (*qtile_fn)(const float *, const uint8_t *, int64_t, float *, int64_t, int64_t);
static const qtile_fn Q4TILES[QMAX_M + 1] = {0, Q4tile_1, Q4tile_2, Q4tile_3, Q4tile_4};
static const qtile_fn Q8TILES[QMAX_M + 1] = {0, Q8tile_1, Q8tile_2, Q8tile_3, Q8tile_4};

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

/* x: [M, K] with M <= QMAX_M; wq: [N/8][K/QK] blocks of one format (tiles: its kernels);
 * out: [M, N] (N a multiple of 8 * QNT, K of QK). Returns 0, -1 for a bad M, K or
 * N, -2 when out of memory. */
static int small_gemm_q(const float *x, const uint8_t *wq, int M, int64_t K, int64_t N, float *out, int nthreads,
                        const qtile_fn *tiles, int64_t block) {
    if (M < 1 || M > QMAX_M || N % (TILE * QNT) || K % QK) return -1;
    float *xt = rows_k_major(x, M, K);
    if (!xt) return -2;
    const int64_t tile_bytes = K / QK * block;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < N / TILE; t += QNT) tiles[M](xt, wq + t * tile_bytes, K, out + t * TILE, N, tile_bytes);
    free(xt);
    return 0;
}

int small_gemm_q4(const float *x, const uint8_t *wq, int M, int64_t K, int64_t N, float *out, int nthreads) {
    return small_gemm_q(x, wq, M, K, N, out, nthreads, Q4TILES, Q4_BLOCK);
}

int small_gemm_q8(const float *x, const uint8_t *wq, int M, int64_t K, int64_t N, float *out, int nthreads) {
    return small_gemm_q(x, wq, M, K, N, out, nthreads, Q8TILES, Q8_BLOCK);
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
