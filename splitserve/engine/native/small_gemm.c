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

/* Block tiles: the checkpoint's own weights (a GGUF file's blocks of QK k steps of one output
 * column), turned into floats in registers. Four layouts, per tile of 8 columns and QK k steps
 * (column c at lane c):
 *   Q4 (Q4_BLOCK bytes): d[8], m[8] as float, then QK/2 pairs of k steps, 8 bytes each: the even
 *      k's code in the low nibble, the odd k's in the high one; w = d * q + m, q in 0..15.
 *      GGUF's Q4_1 (m its own) and Q4_0 (m = -8 d: w = d * (q - 8)).
 *   Q8 (Q8_BLOCK bytes): d[8] as float, then QK/2 pairs of k steps, 16 bytes each: the even k's
 *      8 codes, then the odd k's; w = d * q, q in -128..127. GGUF's Q8_0.
 *   F16, B16 (H_BLOCK bytes): no scales; QK/2 pairs of k steps, 32 bytes each: the even k's 8
 *      halves, then the odd k's. GGUF's F16 and BF16.
 * d and m are fp16 values, so d * q is exact (11 bits times 4 or 8) and one FMA gives the float
 * gguf-py's dequantize gives (d * q + m, rounded once; for Q4_0 d * (q - 8) is itself a float, so
 * the FMA's one rounding leaves it as it is); halves widen exactly. Every product and every sum
 * is then the one the fp32 tile above computes on the de-quantized weights, and so is the
 * result. Reading 4-16 bits a weight instead of 32 is what makes a step of a few rows faster. */
#define QPREFETCH 4 /* blocks ahead in each tile (8, 16, 32: no faster) */
#define QK 32
#define Q4_HEAD 64
#define Q4_PAIR 8
#define Q4_BLOCK (Q4_HEAD + QK / 2 * Q4_PAIR)
#define Q8_HEAD 32
#define Q8_PAIR 16
#define Q8_BLOCK (Q8_HEAD + QK / 2 * Q8_PAIR)
#define F16_HEAD 0
#define F16_PAIR 32
#define F16_BLOCK (QK / 2 * F16_PAIR)
#define B16_HEAD 0
#define B16_PAIR 32
#define B16_BLOCK (QK / 2 * B16_PAIR)

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

static inline void F16_head(const uint8_t *b, __m256 *d, __m256 *m) {
    (void)b;
    *d = *m = _mm256_setzero_ps(); /* unused */
}

static inline void F16_pair(const uint8_t *q, __m256 d, __m256 m, __m256 *w0, __m256 *w1) {
    (void)d, (void)m;
    *w0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)q));
    *w1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)q + 1));
}

#define B16_head F16_head

static inline void B16_pair(const uint8_t *q, __m256 d, __m256 m, __m256 *w0, __m256 *w1) {
    (void)d, (void)m;
    const __m256i a = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)q));
    const __m256i b = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)q + 1));
    *w0 = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16));
    *w1 = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
}

/* MM rows times NT block tiles side by side. With one row, one tile is one chain of dependent
 * FMAs (4 cycles each) and the step waits on that chain, not on memory; NT tiles give NT
 * independent chains. MM * NT accumulators stay within the 16 registers less the weights'.
 * Each output element still sums over k in order. */
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
                    _mm_prefetch((const char *)(b + QPREFETCH * F##_BLOCK + o), _MM_HINT_T0);        \
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

/* Tiles a call takes, by rows: 4 chains a row up to 4 rows, then 2, then 1 (16 accumulators spill). A weight's
 * columns are a multiple of 8 * QNT, so every call's tiles are whole. */
#define QNT 4
#define KERNELS(F)                                                                                   \
    QKERNEL(F, 1, 4) QKERNEL(F, 2, 4) QKERNEL(F, 3, 4) QKERNEL(F, 4, 4) QKERNEL(F, 5, 2)              \
    QKERNEL(F, 6, 2) QKERNEL(F, 7, 1) QKERNEL(F, 8, 1)                                                \
    static const qtile_fn F##TILES[GROUP + 1] = {0,         F##tile_1, F##tile_2, F##tile_3, F##tile_4, \
                                                 F##tile_5, F##tile_6, F##tile_7, F##tile_8};

typedef void (*qtile_fn)(const float *, const uint8_t *, int64_t, float *, int64_t, int64_t);
#ifndef __AVX512F__
KERNELS(Q4)
KERNELS(Q8)
KERNELS(F16)
KERNELS(B16)
static const int QTILES_NT[GROUP + 1] = {0, 4, 4, 4, 4, 2, 2, 1, 1};
#else
/* With AVX-512, two tiles side by side in each 512-bit vector (tile j's 8 columns in lanes 0-7,
 * tile j+1's in 8-15): the same operations on each weight and each sum, in the same order, so
 * the same floats as the 256-bit kernels, in half the instructions. Up to 8 rows x 4 tiles is
 * 16 accumulators of the 32 registers, so every row count takes QNT tiles. */
static inline __m512 join_ps(const uint8_t *a, const uint8_t *b) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_loadu_pd((const double *)a)),
                                               _mm256_loadu_pd((const double *)b), 1));
}

static inline __m256i join_si128(const uint8_t *a, const uint8_t *b) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                   _mm_loadu_si128((const __m128i *)b), 1);
}

static inline void Q4_head2(const uint8_t *a, const uint8_t *b, __m512 *d, __m512 *m) {
    *d = join_ps(a, b);
    *m = join_ps(a + 32, b + 32);
}

static inline void Q4_pair2(const uint8_t *qa, const uint8_t *qb, __m512 d, __m512 m, __m512 *w0, __m512 *w1) {
    const __m128i bytes = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)qa), _mm_loadl_epi64((const __m128i *)qb));
    const __m512i v = _mm512_cvtepu8_epi32(bytes);
    *w0 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))), m);
    *w1 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), m);
}

static inline void Q8_head2(const uint8_t *a, const uint8_t *b, __m512 *d, __m512 *m) {
    *d = join_ps(a, b);
    *m = _mm512_setzero_ps(); /* unused */
}

static inline void Q8_pair2(const uint8_t *qa, const uint8_t *qb, __m512 d, __m512 m, __m512 *w0, __m512 *w1) {
    (void)m;
    const __m128i a = _mm_loadu_si128((const __m128i *)qa), b = _mm_loadu_si128((const __m128i *)qb);
    *w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi64(a, b))));
    *w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi64(a, b))));
}

static inline void F16_head2(const uint8_t *a, const uint8_t *b, __m512 *d, __m512 *m) {
    (void)a, (void)b;
    *d = *m = _mm512_setzero_ps(); /* unused */
}

static inline void F16_pair2(const uint8_t *qa, const uint8_t *qb, __m512 d, __m512 m, __m512 *w0, __m512 *w1) {
    (void)d, (void)m;
    *w0 = _mm512_cvtph_ps(join_si128(qa, qb));
    *w1 = _mm512_cvtph_ps(join_si128(qa + 16, qb + 16));
}

#define B16_head2 F16_head2

static inline void B16_pair2(const uint8_t *qa, const uint8_t *qb, __m512 d, __m512 m, __m512 *w0, __m512 *w1) {
    (void)d, (void)m;
    *w0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(join_si128(qa, qb)), 16));
    *w1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(join_si128(qa + 16, qb + 16)), 16));
}

#define QKERNEL512(F, MM)                                                                            \
    static void F##tile_##MM(const float *xt, const uint8_t *w, int64_t K, float *out, int64_t ldo, \
                             int64_t tile_bytes) {                                                   \
        __m512 acc[MM][QNT / 2];                                                                     \
        for (int m = 0; m < MM; m++)                                                                 \
            for (int j = 0; j < QNT / 2; j++) acc[m][j] = _mm512_setzero_ps();                       \
        for (int64_t k0 = 0; k0 < K; k0 += QK, w += F##_BLOCK) {                                     \
            __m512 d[QNT / 2], mo[QNT / 2];                                                          \
            for (int j = 0; j < QNT; j++)                                                            \
                for (int o = 0; o < F##_BLOCK; o += 64)                                              \
                    _mm_prefetch((const char *)(w + j * tile_bytes + QPREFETCH * F##_BLOCK + o), _MM_HINT_T0); \
            for (int j = 0; j < QNT / 2; j++)                                                        \
                F##_head2(w + 2 * j * tile_bytes, w + (2 * j + 1) * tile_bytes, &d[j], &mo[j]);      \
            for (int64_t p = 0; p < QK / 2; p++) {                                                   \
                const int64_t k = k0 + 2 * p;                                                        \
                for (int j = 0; j < QNT / 2; j++) {                                                  \
                    __m512 w0, w1;                                                                   \
                    const int64_t at = F##_HEAD + p * F##_PAIR;                                      \
                    F##_pair2(w + 2 * j * tile_bytes + at, w + (2 * j + 1) * tile_bytes + at, d[j], mo[j], &w0, &w1); \
                    for (int m = 0; m < MM; m++)                                                     \
                        acc[m][j] = _mm512_fmadd_ps(_mm512_set1_ps(xt[k * MM + m]), w0, acc[m][j]);  \
                    for (int m = 0; m < MM; m++)                                                     \
                        acc[m][j] = _mm512_fmadd_ps(_mm512_set1_ps(xt[(k + 1) * MM + m]), w1, acc[m][j]); \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
        for (int m = 0; m < MM; m++)                                                                 \
            for (int j = 0; j < QNT / 2; j++) {                                                      \
                _mm256_storeu_ps(out + m * ldo + 2 * j * TILE, _mm512_castps512_ps256(acc[m][j]));   \
                _mm256_storeu_ps(out + m * ldo + (2 * j + 1) * TILE,                                 \
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[m][j]), 1))); \
            }                                                                                        \
    }
#define KERNELS512(F)                                                                                \
    QKERNEL512(F, 1) QKERNEL512(F, 2) QKERNEL512(F, 3) QKERNEL512(F, 4) QKERNEL512(F, 5)             \
    QKERNEL512(F, 6) QKERNEL512(F, 7) QKERNEL512(F, 8)                                                \
    static const qtile_fn F##TILES[GROUP + 1] = {0,         F##tile_1, F##tile_2, F##tile_3, F##tile_4, \
                                                 F##tile_5, F##tile_6, F##tile_7, F##tile_8};
KERNELS512(Q4)
KERNELS512(Q8)
KERNELS512(F16)
KERNELS512(B16)
static const int QTILES_NT[GROUP + 1] = {0, 4, 4, 4, 4, 4, 4, 4, 4};
#endif

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

/* Block layouts by number (SmallGemm.LAYOUTS): kernels and bytes per block. */
static const qtile_fn *const LAYOUT_TILES[] = {Q4TILES, Q8TILES, F16TILES, B16TILES};
static const int64_t LAYOUT_BLOCK[] = {Q4_BLOCK, Q8_BLOCK, F16_BLOCK, B16_BLOCK};

/* x: [M, K]; wq: [N/8][K/QK] blocks of one layout (0 Q4, 1 Q8, 2 F16, 3 B16); out: [M, N]
 * (N a multiple of 8 * QNT, K of QK). Rows go in groups of GROUP; a thread's tiles stay in
 * cache from one group to the next. Returns 0, -1 for a bad M, K, N or layout, -2 when out
 * of memory. */
int small_gemm_blocks(const float *x, const uint8_t *wq, int M, int64_t K, int64_t N, float *out, int nthreads,
                      int layout) {
    if (M < 1 || N % (TILE * QNT) || K % QK || layout < 0 || layout > 3) return -1;
    float *xt = rows_k_major(x, M, K);
    if (!xt) return -2;
    const qtile_fn *tiles = LAYOUT_TILES[layout];
    const int64_t tile_bytes = K / QK * LAYOUT_BLOCK[layout];
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t0 = 0; t0 < N / TILE; t0 += QNT)
        for (int g = 0; g < M; g += GROUP) {
            const int rows = M - g < GROUP ? M - g : GROUP;
            const int nt = QTILES_NT[rows];
            for (int64_t t = t0; t < t0 + QNT; t += nt)
                tiles[rows](xt + (int64_t)g * K, wq + t * tile_bytes, K, out + (int64_t)g * N + t * TILE, N,
                            tile_bytes);
        }
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
