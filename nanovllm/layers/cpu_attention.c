/* Paged attention on CPU, reading K/V blocks in place (no gather copy).
 *
 * Each "row" is one query token (all heads) attending to the first row_ctx[r] positions of the
 * sequence whose block table is block_tables[row_table[r]]. A decode step has one row per
 * sequence; a prompt chunk after cached blocks has one row per token with growing contexts.
 * Rows are spread over OpenMP threads. torch is loaded first and ships libgomp.so.1 under the
 * same soname, so this library binds to torch's OpenMP runtime: one thread pool, no second set
 * of spinning threads competing for the cores.
 *
 * One pass over the context, a cache block at a time, with an online softmax: each block's K
 * and V rows (all heads, contiguous) are read from memory once, scores live in a block-sized
 * scratch row, and the output accumulators are rescaled when a block raises a head's maximum.
 *
 * Layouts: q rows are H*D contiguous floats, q_row_stride floats apart (a view into the fused
 * qkv projection); caches are [num_blocks, block_size, KVH, D]; out is [R, H, D] contiguous.
 * Returns 0, -1 if scratch memory could not be allocated, or -2 for a head size over 256.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

/* s[i] = exp(s[i] - mx) for i < n; returns their sum. s has room for n rounded up to 8. */
static inline float exp_shifted(float *s, int64_t n, float mx) {
    v8f sum = {0};
    for (int64_t i = 0; i < n; i += 8) {
        v8f x = exp8(load8(s + i) - mx);
        if (i + 8 > n)  /* zero the lanes past n */
            for (int64_t j = n - i; j < 8; j++) x[j] = 0.f;
        store8(s + i, x);
        sum += x;
    }
    return hsum8(sum);
}

/* Scores of one query head against n cached keys, key i at k + i * stride. */
static inline void scores_block(const float *restrict qh, const float *k, float *restrict s, int64_t n,
                                int64_t stride, int64_t D_rt, float scale, const int64_t HD) {
    const int64_t D = HD ? HD : D_rt;
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (HD && HD % 8 == 0) {
        /* Eight keys at a time: eight independent FMA chains (one per key) instead of one long
         * dependent chain per dot product, then one transpose-and-add for the eight sums. */
        for (; i + 8 <= n; i += 8) {
            __m256 a[8];
            for (int t = 0; t < 8; t++) {
                const float *kt = k + (i + t) * stride;
                __m256 x = _mm256_mul_ps(_mm256_loadu_ps(qh), _mm256_loadu_ps(kt));
                for (int64_t j = 8; j < HD; j += 8) x = _mm256_fmadd_ps(_mm256_loadu_ps(qh + j), _mm256_loadu_ps(kt + j), x);
                a[t] = x;
            }
            const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
            const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
            const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
            const __m256 lo = _mm256_permute2f128_ps(h0123, h4567, 0x20);
            const __m256 hi = _mm256_permute2f128_ps(h0123, h4567, 0x31);
            _mm256_storeu_ps(s + i, _mm256_mul_ps(_mm256_add_ps(lo, hi), _mm256_set1_ps(scale)));
        }
    }
#endif
    for (; i < n; i++) {
        const float *kt = k + i * stride;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; d++) dot += qh[d] * kt[d];
        s[i] = dot * scale;
    }
}

/* acc = acc * alpha + sum_i p[i] * v_i over n value rows (row i at v + i * stride). With a
 * compile-time head size the accumulator is held in 32-float slices of four 8-lane registers,
 * so it stays in registers across the rows instead of going through memory on every one. */
static inline void accumulate_values(float *restrict acc, const float *v, const float *restrict p, int64_t n,
                                     int64_t stride, float alpha, int64_t D_rt, const int64_t HD) {
    if (HD && HD % 32 == 0) {
        for (int64_t c = 0; c < HD; c += 32) {
            v8f a0 = load8(acc + c) * alpha, a1 = load8(acc + c + 8) * alpha;
            v8f a2 = load8(acc + c + 16) * alpha, a3 = load8(acc + c + 24) * alpha;
            for (int64_t i = 0; i < n; i++) {
                const float *vi = v + i * stride + c;
                const float pi = p[i];
                a0 += pi * load8(vi);
                a1 += pi * load8(vi + 8);
                a2 += pi * load8(vi + 16);
                a3 += pi * load8(vi + 24);
            }
            store8(acc + c, a0); store8(acc + c + 8, a1);
            store8(acc + c + 16, a2); store8(acc + c + 24, a3);
        }
        return;
    }
    const int64_t D = HD ? HD : D_rt;
    for (int64_t d = 0; d < D; d++) acc[d] *= alpha;
    for (int64_t i = 0; i < n; i++) {
        const float pi = p[i], *vi = v + i * stride;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) acc[d] += pi * vi[d];
    }
}

static inline void attend_row(const float *restrict q, float *restrict out, const float *k_cache,
                              const float *v_cache, const int64_t *table, float *restrict acc,
                              float *restrict s, float *restrict m, float *restrict l, int64_t L,
                              int64_t H, int64_t KVH, int64_t D_rt, int64_t BS, int64_t BSP,
                              float scale, const int64_t HD) {
    const int64_t D = HD ? HD : D_rt, G = H / KVH, row = KVH * D;
    for (int64_t h = 0; h < H; h++) { m[h] = -INFINITY; l[h] = 0.f; }
    memset(acc, 0, sizeof(float) * H * D);
    for (int64_t t0 = 0, b = 0; t0 < L; t0 += BS, b++) {
        const int64_t n = (L - t0 < BS) ? L - t0 : BS;
        const int64_t base = table[b] * BS * row;
        const float *kb = k_cache + base, *vb = v_cache + base;
        /* Blocks are scattered, so the hardware prefetchers restart at each one: while the scores
         * of this block are computed, fetch its V rows and the next block's K rows, a slice per
         * head so the requests spread over the work instead of queueing up at once. */
        const float *k_next = t0 + BS < L ? k_cache + table[b + 1] * BS * row : NULL;
        const int64_t slice = (BS * row + H - 1) / H;
        for (int64_t h = 0; h < H; h++) {
            const int64_t lo = h * slice, hi = (h + 1) * slice;
            for (int64_t j = lo; j < hi && j < n * row; j += 16) __builtin_prefetch(vb + j);
            if (k_next != NULL)
                for (int64_t j = lo; j < hi && j < BS * row; j += 16) __builtin_prefetch(k_next + j);
            scores_block(q + h * D, kb + (h / G) * D, s + h * BSP, n, row, D, scale, HD);
        }
        for (int64_t h = 0; h < H; h++) {
            float *sh = s + h * BSP, mx = m[h];
            for (int64_t i = 0; i < n; i++) mx = sh[i] > mx ? sh[i] : mx;
            const float alpha = mx == m[h] ? 1.f : expf(m[h] - mx);  /* 1 once the maximum settles */
            const float sum = exp_shifted(sh, n, mx);
            l[h] = l[h] * alpha + sum;
            m[h] = mx;
            float *ah = acc + h * D;
            accumulate_values(ah, vb + (h / G) * D, sh, n, row, alpha, D, HD);
        }
    }
    for (int64_t h = 0; h < H; h++) {
        const float inv = 1.f / l[h];
        for (int64_t d = 0; d < D; d++) out[h * D + d] = acc[h * D + d] * inv;
    }
}

int paged_attention_rows_f32(const float *q, int64_t q_row_stride, const float *k_cache,
                             const float *v_cache, const int64_t *block_tables, int64_t max_blocks,
                             const int64_t *row_table, const int64_t *row_ctx, float *out,
                             int64_t num_rows, int64_t H, int64_t KVH, int64_t D, int64_t BS,
                             float scale) {
    if (D > 256) return -2;
    const int64_t BSP = (BS + 7) / 8 * 8;  /* a head's score row, padded for 8-lane exp */
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
    float *scratch = (float *)malloc(sizeof(float) * (H * D + H * BSP + 2 * H));
    failed = scratch == NULL;
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < num_rows; r++) {
        if (failed) continue;
        const int64_t L = row_ctx[r];
        const int64_t *table = block_tables + row_table[r] * max_blocks;
        const float *qr = q + r * q_row_stride;
        float *o = out + r * H * D;
        if (L == 0) { memset(o, 0, sizeof(float) * H * D); continue; }
        float *acc = scratch, *s = acc + H * D, *m = s + H * BSP, *l = m + H;
        if (D == 64)
            attend_row(qr, o, k_cache, v_cache, table, acc, s, m, l, L, H, KVH, D, BS, BSP, scale, 64);
        else if (D == 128)
            attend_row(qr, o, k_cache, v_cache, table, acc, s, m, l, L, H, KVH, D, BS, BSP, scale, 128);
        else
            attend_row(qr, o, k_cache, v_cache, table, acc, s, m, l, L, H, KVH, D, BS, BSP, scale, 0);
    }
    free(scratch);
    }
    return failed ? -1 : 0;
}
