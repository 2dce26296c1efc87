/* Paged attention on CPU, reading K/V blocks in place (no gather copy).
 *
 * Each "row" is one query token (all heads) attending to the first row_ctx[r] positions of the
 * sequence whose block table is block_tables[row_table[r]]. A decode step has one row per
 * sequence; a prompt chunk after cached blocks has one row per token with growing contexts.
 * Single-threaded: the caller splits rows across threads (ctypes releases the GIL).
 *
 * Layouts: q rows are H*D contiguous floats, q_row_stride floats apart (a view into the fused
 * qkv projection); caches are [num_blocks, block_size, KVH, D]; out is [R, H, D] contiguous.
 * Returns 0, or -1 if scratch memory could not be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float *y, float a, const float *x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

int paged_attention_rows_f32(const float *q, int64_t q_row_stride, const float *k_cache,
                             const float *v_cache, const int64_t *block_tables, int64_t max_blocks,
                             const int64_t *row_table, const int64_t *row_ctx, float *out,
                             int64_t row_begin, int64_t row_end, int64_t H, int64_t KVH, int64_t D,
                             int64_t BS, float scale) {
    const int64_t G = H / KVH;
    int64_t max_ctx = 1;
    for (int64_t r = row_begin; r < row_end; r++)
        if (row_ctx[r] > max_ctx) max_ctx = row_ctx[r];
    float *scores = (float *)malloc(sizeof(float) * G * max_ctx);
    if (!scores) return -1;

    for (int64_t r = row_begin; r < row_end; r++) {
        const int64_t L = row_ctx[r];
        const int64_t *table = block_tables + row_table[r] * max_blocks;
        for (int64_t kvh = 0; kvh < KVH; kvh++) {
            const float *qh = q + r * q_row_stride + kvh * G * D;
            float *oh = out + (r * H + kvh * G) * D;
            memset(oh, 0, sizeof(float) * G * D);
            if (L == 0) continue;
            /* scores[g][t] = q_g . k_t * scale, walking the sequence block by block */
            for (int64_t t0 = 0; t0 < L; t0 += BS) {
                const int64_t n = (L - t0 < BS) ? L - t0 : BS;
                const float *kb = k_cache + (table[t0 / BS] * BS * KVH + kvh) * D;
                for (int64_t i = 0; i < n; i++)
                    for (int64_t g = 0; g < G; g++)
                        scores[g * L + t0 + i] = dot(qh + g * D, kb + i * KVH * D, D) * scale;
            }
            for (int64_t g = 0; g < G; g++) {
                float *s = scores + g * L, m = -INFINITY, sum = 0.f;
                for (int64_t t = 0; t < L; t++) m = s[t] > m ? s[t] : m;
                for (int64_t t = 0; t < L; t++) { s[t] = expf(s[t] - m); sum += s[t]; }
                const float inv = 1.f / sum;
                for (int64_t t = 0; t < L; t++) s[t] *= inv;
            }
            for (int64_t t0 = 0; t0 < L; t0 += BS) {
                const int64_t n = (L - t0 < BS) ? L - t0 : BS;
                const float *vb = v_cache + (table[t0 / BS] * BS * KVH + kvh) * D;
                for (int64_t i = 0; i < n; i++)
                    for (int64_t g = 0; g < G; g++)
                        axpy(oh + g * D, scores[g * L + t0 + i], vb + i * KVH * D, D);
            }
        }
    }
    free(scores);
    return 0;
}
