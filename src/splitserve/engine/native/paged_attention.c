/* Paged attention for sequences that read their context from the KV cache.
 *
 * One task per sequence (or per (sequence, KV head) when sequences are few); the
 * G = Hq / Hkv query heads that share a KV head read the same K/V rows. Keys are found by slot number (block * block_size + offset),
 * so nothing is gathered or padded. Causal within a chunk: query i of a sequence with
 * q_len new tokens at the end of ctx_len sees keys [0, ctx_len - q_len + i].
 *
 * q:     [T, Hq, D]         out: [T, Hq, D]
 * k, v:  [slots, Hkv, D]    (one layer of the paged cache)
 * info:  [S, 4] int64 = q_start, q_len, ctx_len, offset into slots
 * slots: [sum ctx_len] int64
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static float dot(const float *a, const float *b, int n) {
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

int paged_attention(const float *q, const float *k, const float *v, const int64_t *info, const int64_t *slots,
                    int S, int Hq, int Hkv, int D, float scale, float *out, int nthreads) {
    const int G = Hq / Hkv;
    if (G * Hkv != Hq) return -1;
    int64_t max_ctx = 0;
    for (int s = 0; s < S; s++) max_ctx = info[4 * s + 2] > max_ctx ? info[4 * s + 2] : max_ctx;
    /* NOTE: a task covers every KV head of a sequence (whole 768-byte rows are read
     * contiguously) unless there are too few sequences to keep the threads busy. */
    const int hpt = S >= 2 * nthreads ? Hkv : 1; /* KV heads per task */
    const int tasks_per_seq = Hkv / hpt;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *scores = malloc(sizeof(float) * (size_t)max_ctx * Hq); /* [Hq, ctx] */
        if (!scores) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < S * tasks_per_seq; task++) {
            if (!scores) continue;
            const int s = task / tasks_per_seq, h0 = (task % tasks_per_seq) * hpt, h1 = h0 + hpt;
            const int64_t q_start = info[4 * s], q_len = info[4 * s + 1], ctx = info[4 * s + 2];
            const int64_t *sl = slots + info[4 * s + 3];
            for (int64_t i = 0; i < q_len; i++) {
                const int64_t nk = ctx - q_len + i + 1;
                const float *qi = q + (q_start + i) * Hq * D; /* [Hq, D] */
                float *o = out + (q_start + i) * Hq * D;
                for (int kh = h0; kh < h1; kh++)
                    for (int g = 0; g < G; g++) {
                        const int h = kh * G + g;
                        float *sh = scores + h * max_ctx, mx = -INFINITY, sum = 0.f;
                        for (int64_t j = 0; j < nk; j++) {
                            const float x = dot(qi + h * D, k + (sl[j] * Hkv + kh) * D, D) * scale;
                            sh[j] = x;
                            mx = x > mx ? x : mx;
                        }
                        for (int64_t j = 0; j < nk; j++) {
                            sh[j] = expf(sh[j] - mx);
                            sum += sh[j];
                        }
                        const float inv = 1.f / sum;
                        for (int64_t j = 0; j < nk; j++) sh[j] *= inv;
                        for (int d = 0; d < D; d++) o[h * D + d] = 0.f;
                    }
                for (int64_t j = 0; j < nk; j++) {
                    const float *vr = v + sl[j] * Hkv * D;
                    for (int kh = h0; kh < h1; kh++)
                        for (int g = 0; g < G; g++) {
                            const int h = kh * G + g;
                            const float p = scores[h * max_ctx + j];
                            float *oh = o + h * D;
                            const float *vh = vr + kh * D;
#pragma omp simd
                            for (int d = 0; d < D; d++) oh[d] += p * vh[d];
                        }
                }
            }
        }
        free(scores);
    }
    return failed ? -2 : 0;
}
