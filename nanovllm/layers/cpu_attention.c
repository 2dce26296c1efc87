/* Paged attention on CPU, reading K/V blocks in place (no gather copy).
 *
 * Each "row" is one query token (all heads) attending to the first row_ctx[r] positions of the
 * sequence whose block table is block_tables[row_table[r]]. A decode step has one row per
 * sequence; a prompt chunk after cached blocks has one row per token with growing contexts.
 * Rows are spread over OpenMP threads. torch is loaded first and ships libgomp.so.1 under the
 * same soname, so this library binds to torch's OpenMP runtime: one thread pool, no second set
 * of spinning threads competing for the cores.
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
                             int64_t num_rows, int64_t H, int64_t KVH, int64_t D, int64_t BS,
                             float scale) {
    const int64_t G = H / KVH;
    int64_t max_ctx = 1;
    for (int64_t r = 0; r < num_rows; r++)
        if (row_ctx[r] > max_ctx) max_ctx = row_ctx[r];
    int failed = 0;

#pragma omp parallel reduction(| : failed)
    {
    float *scores = (float *)malloc(sizeof(float) * G * max_ctx);
    failed = scores == NULL;
    /* One work item per (row, kv head); dynamic because contexts differ a lot in length. */
#pragma omp for schedule(dynamic, 4)
    for (int64_t item = 0; item < num_rows * KVH; item++) {
        if (failed) continue;
        const int64_t r = item / KVH, kvh = item % KVH;
        const int64_t L = row_ctx[r];
        const int64_t *table = block_tables + row_table[r] * max_blocks;
        {
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
    }
    return failed ? -1 : 0;
}
