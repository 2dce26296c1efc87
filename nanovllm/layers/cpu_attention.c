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
 * Returns 0, -1 if scratch memory could not be allocated, or -2 for a head size over 256.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* One (row, kv head) item: G query heads against L cached tokens. HD is a compile-time head
 * size where the caller can give one, so the query, the scores' dot products and the output
 * accumulator stay in vector registers; HD == 0 means "use the runtime D". */
static inline void attend_item(const float *restrict qh, float *restrict oh, const float *k_cache,
                               const float *v_cache, const int64_t *table, float *restrict scores,
                               int64_t L, int64_t G, int64_t KVH, int64_t kvh, int64_t D_rt,
                               int64_t BS, float scale, const int64_t HD) {
    const int64_t D = HD ? HD : D_rt;
    for (int64_t t0 = 0; t0 < L; t0 += BS) {
        const int64_t n = (L - t0 < BS) ? L - t0 : BS;
        const float *kb = k_cache + (table[t0 / BS] * BS * KVH + kvh) * D;
        for (int64_t i = 0; i < n; i++) {
            const float *k = kb + i * KVH * D;
            for (int64_t g = 0; g < G; g++) {
                const float *qg = qh + g * D;
                float s = 0.f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < D; d++) s += qg[d] * k[d];
                scores[g * L + t0 + i] = s * scale;
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *s = scores + g * L, m = s[0], sum = 0.f;
        for (int64_t t = 1; t < L; t++) m = s[t] > m ? s[t] : m;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < L; t++) { s[t] = expf(s[t] - m); sum += s[t]; }
        const float inv = 1.f / sum;
        float acc[HD ? HD : 256];  /* D <= 256 is checked by the caller */
        for (int64_t d = 0; d < D; d++) acc[d] = 0.f;
        for (int64_t t0 = 0; t0 < L; t0 += BS) {
            const int64_t n = (L - t0 < BS) ? L - t0 : BS;
            const float *vb = v_cache + (table[t0 / BS] * BS * KVH + kvh) * D;
            for (int64_t i = 0; i < n; i++) {
                const float p = s[t0 + i], *v = vb + i * KVH * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) acc[d] += p * v[d];
            }
        }
        for (int64_t d = 0; d < D; d++) oh[g * D + d] = acc[d] * inv;
    }
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
    if (D > 256) return -2;
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
            if (L == 0) {
                memset(oh, 0, sizeof(float) * G * D);
                continue;
            }
            if (D == 64)
                attend_item(qh, oh, k_cache, v_cache, table, scores, L, G, KVH, kvh, D, BS, scale, 64);
            else if (D == 128)
                attend_item(qh, oh, k_cache, v_cache, table, scores, L, G, KVH, kvh, D, BS, scale, 128);
            else
                attend_item(qh, oh, k_cache, v_cache, table, scores, L, G, KVH, kvh, D, BS, scale, 0);
        }
    }
    free(scores);
    }
    return failed ? -1 : 0;
}
