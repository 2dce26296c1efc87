/* Paged attention on CPU, reading K/V blocks in place (no gather copy).
 *
 * Each "row" is one query token (all heads) attending to the first row_ctx[r] positions of the
 * sequence whose block table is block_tables[row_table[r]]. A decode step has one row per
 * sequence. (A prompt chunk could be rows with growing contexts too; paged_attention_chunk, at the
 * end of this file, computes it in tiles of rows instead.)
 * Rows are spread over OpenMP threads (with fewer rows than threads, a row's heads), in a team of
 * this file's own or in one that a caller already runs (paged_attention_items: cpu_decode.c runs a
 * whole decode step in one team). torch is loaded first and ships libgomp.so.1 under the
 * same soname, so this library binds to torch's OpenMP runtime: one thread pool, no second set
 * of spinning threads competing for the cores.
 *
 * One pass over the context, a cache block at a time, with an online softmax: each block's K
 * and V rows (all heads, contiguous) are read from memory once, scores live in a block-sized
 * scratch row, and the output accumulators are rescaled when a block raises a head's maximum.
 *
 * Layouts: q rows are H*D contiguous elements, q_row_stride elements apart (a view into the
 * fused qkv projection); caches are [num_blocks, block_size, KVH, D]; out is [R, H, D] contiguous.
 * q, the caches and out are all float32 or all bfloat16 (`bf16`); the arithmetic is float32 either
 * way (bf16 rows are widened as they are read; a row's q once, up front), and out is rounded to
 * bf16 once at the end. Returns 0, -1 if scratch memory could not be allocated, or -2 for a head
 * size over 256.
 */
// [ZH-START]
// 本文件在整体架构中的位置：引擎一步（step）之内的注意力计算，CPU 路径。
//
//   scheduler → step_input（块表、每行上下文长度）→ model_runner → 每层 Attention
//       → qk_norm_rope_store（cpu_ops.c：新 token 的 K/V 先写进 KV cache）
//       → paged_attention_rows（decode 行）/ paged_attention_chunk（prefill 分块）
//          （本文件：读缓存做注意力）→ o_proj → ... → sampler
//
// 核心思路：KV cache 按物理块（block）分页存放，布局 [num_blocks, block_size, KVH, D]。
// torch 的做法要先把每条序列的块 gather 成一份连续的填充副本；这里直接按块表
// 原地读取，每行（一个查询 token 的全部 head）只遍历一次上下文，用 online softmax
// 逐块累加，所以 K/V 每块只从内存读一次。
// float32 与 bfloat16 共用同一份源码：BF 是编译期常量，cpu_simd.h 的 vload/vstore
// 在读时把 bf16 展开成 fp32，写时按就近偶数舍入；所有累加都是 fp32。
// [ZH-END]
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "cpu_simd.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define PARALLEL_MIN_WORK 65536 /* context positions x H x D below which one thread does a step's rows */

/* Prefetch bytes [lo, min(hi, end)) of p into L2 (prefetcht1), a 64-byte line at a time. */
static inline void prefetch_l2(const char *p, int64_t lo, int64_t hi, int64_t end) {
    for (int64_t j = lo; j < hi && j < end; j += 64) __builtin_prefetch(p + j, 0, 2);
}

/* s[i] = exp(s[i] - mx) for i < n; returns their sum. s has room for n rounded up to VL. */
static inline float exp_shifted(float *s, int64_t n, float mx) {
    vf sum = {0};
    for (int64_t i = 0; i < n; i += VL) {
        vf x = vexp(loadv(s + i) - mx);
        if (i + VL > n)  /* zero the lanes past n */
            for (int64_t j = n - i; j < VL; j++) x[j] = 0.f;
        storev(s + i, x);
        sum += x;
    }
    return hsum(sum);
}

#if defined(__AVX2__) && defined(__FMA__)
/* s[0..8) = scale * (the horizontal sum of each of the eight vectors a[0..8)). */
static inline void store_sums8(float *restrict s, const __m256 *a, float scale) {
    const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
    const __m256 lo = _mm256_permute2f128_ps(h0123, h4567, 0x20);
    const __m256 hi = _mm256_permute2f128_ps(h0123, h4567, 0x31);
    _mm256_storeu_ps(s, _mm256_mul_ps(_mm256_add_ps(lo, hi), _mm256_set1_ps(scale)));
}
#endif

/* Scores of one query head (float) against n cached keys, key i at element k + i * stride, a key
 * at a time: the keys past the last eight, and every key where no wider loop applies. */
static inline void scores_keys(const float *restrict qh, const void *k, float *restrict s, int64_t n,
                               int64_t stride, int64_t D_rt, float scale, const int64_t HD, const int BF) {
    const int64_t D = HD ? HD : D_rt;
    for (int64_t i = 0; i < n; i++) {
        vf dv = {0};
        int64_t d = 0;
        for (; d + VL <= D; d += VL) dv += loadv(qh + d) * vload(k, i * stride + d, BF);
        float dot = hsum(dv);
        for (; d < D; d++) dot += qh[d] * sload(k, i * stride + d, BF);
        s[i] = dot * scale;
    }
}

/* Query heads of one KV group (GQA) per pass: two where the group size is even, three where it is
 * a multiple of three (the default model's 9 over 3) and the cache bf16, else one. Threes with a
 * float32 cache measured slower than one at a time (0.84-1.02 against 0.66 ms a layer, 64 rows;
 * bf16: 0.57-0.60 against 0.78-0.80), so float32 keeps single heads there. */
static inline int64_t heads_per_pass(int64_t G, int BF) { return G % 2 == 0 ? 2 : BF && G % 3 == 0 ? 3 : 1; }

/* Scores of NG (1 to 3) query heads of one KV group against the same n keys, key i at element
 * k + i * stride: each key is loaded, and in bf16 widened, once for all of them. Head g's query is
 * q + g * D, its scores s + g * BSP. Eight keys at a time: eight independent FMA chains (one per
 * key) instead of one long dependent chain per dot product, then one transpose-and-add for the
 * eight sums; with AVX-512 and a head size a multiple of 16 the chains are 16 lanes wide (half
 * the instructions), each folded to eight lanes before that add. Each head's sums run in the
 * same order whatever NG is, so heads computed together give the bits of heads one at a time. */
static inline __attribute__((always_inline)) void scores_group(const float *restrict q, const void *k,
                                                               float *restrict s, int64_t BSP, int64_t n, int64_t stride,
                                                               int64_t D_rt, float scale, const int64_t HD, const int BF,
                                                               const int NG) {
    const int64_t D = HD ? HD : D_rt;
    int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    if (HD && HD % 16 == 0) {
        for (; i + 8 <= n; i += 8) {
            __m256 a[3][8];
            for (int t = 0; t < 8; t++) {
                const int64_t kt = (i + t) * stride;
                const vf k0 = vload(k, kt, BF);
                vf x[3];
                for (int g = 0; g < NG; g++) x[g] = loadv(q + g * HD) * k0;
                for (int64_t j = 16; j < HD; j += 16) {
                    const vf kj = vload(k, kt + j, BF);
                    for (int g = 0; g < NG; g++) x[g] += loadv(q + g * HD + j) * kj;
                }
                for (int g = 0; g < NG; g++)
                    a[g][t] = _mm256_add_ps(_mm512_castps512_ps256((__m512)x[g]),
                                            _mm256_castpd_ps(_mm512_extractf64x4_pd((__m512d)x[g], 1)));
            }
            for (int g = 0; g < NG; g++) store_sums8(s + g * BSP + i, a[g], scale);
        }
    }
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (HD && HD % 8 == 0 && (VL == 8 || HD % 16 != 0)) {
        for (; i + 8 <= n; i += 8) {
            __m256 a[3][8];
            for (int t = 0; t < 8; t++) {
                const int64_t kt = (i + t) * stride;
                const __m256 k0 = (__m256)load8x(k, kt, BF);
                for (int g = 0; g < NG; g++) a[g][t] = _mm256_mul_ps(_mm256_loadu_ps(q + g * HD), k0);
                for (int64_t j = 8; j < HD; j += 8) {
                    const __m256 kj = (__m256)load8x(k, kt + j, BF);
                    for (int g = 0; g < NG; g++) a[g][t] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * HD + j), kj, a[g][t]);
                }
            }
            for (int g = 0; g < NG; g++) store_sums8(s + g * BSP + i, a[g], scale);
        }
    }
#endif
    if (i < n)
        for (int g = 0; g < NG; g++)
            scores_keys(q + g * D, at(k, i * stride, BF), s + g * BSP + i, n - i, stride, D_rt, scale, HD, BF);
}

/* acc = acc * alpha + sum_i p[i] * v_i over n value rows (row i at element v + i * stride) for NG
 * (1 to 3) heads of one KV group: head g's accumulator acc + g * D, weights p + g * BSP, factor
 * alpha[g]. With a compile-time head size the accumulators are held in slices of four VL-lane
 * registers, so they stay in registers across the rows instead of going through memory on every
 * one, and each value row is loaded once for all the heads; each head sees the same operations in
 * the same order whatever NG is. */
static inline __attribute__((always_inline)) void accumulate_group(float *restrict acc, const void *v,
                                                                   const float *restrict p, int64_t BSP, int64_t n,
                                                                   int64_t stride, const float *alpha, int64_t D_rt,
                                                                   const int64_t HD, const int BF, const int NG) {
    if (HD && HD % (4 * VL) == 0) {
        for (int64_t c = 0; c < HD; c += 4 * VL) {
            vf a[3][4];
            for (int g = 0; g < NG; g++)
                for (int u = 0; u < 4; u++) a[g][u] = loadv(acc + g * HD + c + u * VL) * alpha[g];
            for (int64_t i = 0; i < n; i++) {
                const int64_t vi = i * stride + c;
                const vf v0 = vload(v, vi, BF), v1 = vload(v, vi + VL, BF);
                const vf v2 = vload(v, vi + 2 * VL, BF), v3 = vload(v, vi + 3 * VL, BF);
                for (int g = 0; g < NG; g++) {
                    const float pi = p[g * BSP + i];
                    a[g][0] += pi * v0; a[g][1] += pi * v1; a[g][2] += pi * v2; a[g][3] += pi * v3;
                }
            }
            for (int g = 0; g < NG; g++)
                for (int u = 0; u < 4; u++) storev(acc + g * HD + c + u * VL, a[g][u]);
        }
        return;
    }
    const int64_t D = HD ? HD : D_rt;
    for (int g = 0; g < NG; g++) {
        float *restrict ag = acc + g * D;
        const float *pg = p + g * BSP;
        for (int64_t d = 0; d < D; d++) ag[d] *= alpha[g];
        for (int64_t i = 0; i < n; i++)
            for (int64_t d = 0; d < D; d++) ag[d] += pg[i] * sload(v, i * stride + d, BF);
    }
}

/* Softmax bookkeeping of one head for one block of n scores (in place: s becomes exp(s - max));
 * returns alpha, the factor its accumulator is rescaled by. */
static inline float softmax_block(float *restrict sh, int64_t n, float *restrict m, float *restrict l) {
    float mx = *m;
    for (int64_t i = 0; i < n; i++) mx = sh[i] > mx ? sh[i] : mx;
    const float alpha = mx == *m ? 1.f : expf(*m - mx);  /* 1 once the maximum settles */
    const float sum = exp_shifted(sh, n, mx);
    *l = *l * alpha + sum;
    *m = mx;
    return alpha;
}

static inline void attend_row(const void *q, void *out, const void *k_cache, const void *v_cache,
                              const int64_t *table, float *restrict qf, float *restrict acc, float *restrict s,
                              float *restrict m, float *restrict l, int64_t L, int64_t H, int64_t KVH, int64_t D_rt,
                              int64_t h0, int64_t h1, int64_t BS, int64_t BSP, float scale, const int64_t HD,
                              const int BF) {
    // [ZH-START]
    // 一行（一个查询 token）的注意力，online softmax，按物理块推进：
    // 1. bf16 时先把这一行的 q（H*D 个元素）展开成 fp32 放进 qf；fp32 直接用原指针。
    // 2. 每个 head 的运行最大值 m[h] = -inf、分母 l[h] = 0，累加器 acc 清零。
    // 3. 对上下文的第 b 块（块号 table[b]，本块有 n = min(BS, L - t0) 个 token）：
    //    a. 算本块分数时预取下一块的 K 行，累加本块 V 时预取下一块的 V 行，都只预取到 L2
    //       （块在内存里是分散的，硬件预取器每块都要重新起步；同样的预取放进 L1
    //       实测比不预取还慢）；
    //    b. 对每个 head 算 n 个分数 s = q·k * scale（GQA：第 h 个 head 读第 h / G 个 KV head）；
    //       G 为偶数时相邻两个 head、G 是 3 的倍数且缓存为 bf16 时相邻三个 head
    //       共用一个 KV head，一组一起算（scores_group / accumulate_group），
    //       K、V 行只读取、展开一次，每个 head 的运算顺序不变，结果与逐个 head 计算逐位相同；
    //       分数一次算 8 个 key（8 条独立的 FMA 链），AVX-512 且 D 是 16 的倍数时每条 16 路宽；
    //    c. 新最大值 mx 若超过 m[h]，旧累加按 alpha = exp(m[h] - mx) 缩放；
    //       s 变成 exp(s - mx)，l[h] = l[h] * alpha + sum(s)；
    //    d. acc[h] = acc[h] * alpha + sum_i s[i] * v_i（单个 head 也走 accumulate_group，NG = 1）。
    // 4. 输出 out[h] = acc[h] / l[h]，bf16 时这里才舍入一次。
    // 只算 [h0, h1) 这些 head（h0 是每组 head 数的倍数）：各 head 互不依赖，
    // 一行可以按 head 分给几个线程。
    // [ZH-END]
    const int64_t D = HD ? HD : D_rt, G = H / KVH, row = KVH * D;
    const int64_t hs = heads_per_pass(G, BF);  /* heads sharing a KV head, read once for them all */
    if (BF) for (int64_t j = h0 * D; j < h1 * D; j++) qf[j] = sload(q, j, BF);
    else qf = (float *)q;
    for (int64_t h = h0; h < h1; h++) { m[h] = -INFINITY; l[h] = 0.f; }
    memset(acc + h0 * D, 0, sizeof(float) * (h1 - h0) * D);
    for (int64_t t0 = 0, b = 0; t0 < L; t0 += BS, b++) {
        const int64_t n = (L - t0 < BS) ? L - t0 : BS;
        const int64_t base = table[b] * BS * row;
        const char *kb = at(k_cache, base, BF), *vb = at(v_cache, base, BF);
        /* Blocks are scattered, so the hardware prefetchers restart at each one: while this block's
         * scores are computed, fetch the next block's K rows, and while its values are summed, the
         * next block's V rows, a slice per head so the requests spread over the work instead of
         * queueing up at once. Into L2, not L1: the same prefetches into L1 measured slower than
         * none (bench/cpu_attention.py). */
        const int last = t0 + BS >= L;
        const char *k_next = last ? NULL : at(k_cache, table[b + 1] * BS * row, BF);
        const char *v_next = last ? NULL : at(v_cache, table[b + 1] * BS * row, BF);
        const int64_t bytes = BS * row * (BF ? 2 : 4), slice = (bytes + H - 1) / H;
        for (int64_t h = h0; h < h1; h += hs) {
            if (!last) prefetch_l2(k_next, h * slice, (h + hs) * slice, bytes);
            const void *kh = at(kb, (h / G) * D, BF);
            if (hs == 3) scores_group(qf + h * D, kh, s + h * BSP, BSP, n, row, D, scale, HD, BF, 3);
            else if (hs == 2) scores_group(qf + h * D, kh, s + h * BSP, BSP, n, row, D, scale, HD, BF, 2);
            else scores_group(qf + h * D, kh, s + h * BSP, BSP, n, row, D, scale, HD, BF, 1);
        }
        for (int64_t h = h0; h < h1; h += hs) {
            const void *vh = at(vb, (h / G) * D, BF);
            if (!last) prefetch_l2(v_next, h * slice, (h + hs) * slice, bytes);
            float alpha[3];
            for (int64_t g = 0; g < hs; g++) alpha[g] = softmax_block(s + (h + g) * BSP, n, m + h + g, l + h + g);
            if (hs == 3) accumulate_group(acc + h * D, vh, s + h * BSP, BSP, n, row, alpha, D, HD, BF, 3);
            else if (hs == 2) accumulate_group(acc + h * D, vh, s + h * BSP, BSP, n, row, alpha, D, HD, BF, 2);
            else accumulate_group(acc + h * D, vh, s + h * BSP, BSP, n, row, alpha, D, HD, BF, 1);
        }
    }
    for (int64_t h = h0; h < h1; h++) {
        const float inv = 1.f / l[h];
        for (int64_t d = 0; d < D; d++) sstore(out, h * D + d, acc[h * D + d] * inv, BF);
    }
}

/* Heads [h0, h1) of one row at each compile-time head size the kernel specialises (and any
 * other at run time). */
static inline void attend_row_any(const void *q, void *out, const void *k_cache, const void *v_cache,
                                  const int64_t *table, float *scratch, int64_t L, int64_t H, int64_t KVH, int64_t D,
                                  int64_t h0, int64_t h1, int64_t BS, int64_t BSP, float scale, const int BF) {
    float *qf = scratch, *acc = qf + H * D, *s = acc + H * D, *m = s + H * BSP, *l = m + H;
#define ROW(DD) attend_row(q, out, k_cache, v_cache, table, qf, acc, s, m, l, L, H, KVH, D, h0, h1, BS, BSP, scale, DD, BF)
    if (D == 64) ROW(64);
    else if (D == 128) ROW(128);
    else ROW(0);
#undef ROW
}

/* Floats of scratch one thread needs for paged_attention_items. */
int64_t paged_attention_scratch(int64_t H, int64_t D, int64_t BS) {
    const int64_t BSP = (BS + VL - 1) / VL * VL;  /* a head's score row, padded for VL-lane exp */
    return 2 * H * D + H * BSP + 2 * H;
}

/* The rows' work, shared out over the threads of the enclosing OpenMP team (alone outside one):
 * a work-shared loop with no barrier at its end. Items are whole rows where there are at least as
 * many rows as threads, and otherwise heads of a row (groups of heads_per_pass), so that
 * one row is not one thread's work while the others wait. `scratch`: this thread's
 * paged_attention_scratch floats. */
void paged_attention_items(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                           const int64_t *block_tables, int64_t max_blocks, const int64_t *row_table,
                           const int64_t *row_ctx, void *out, int64_t num_rows, int64_t H, int64_t KVH, int64_t D,
                           int64_t BS, float scale, int64_t bf16, float *scratch) {
    const int BF = bf16 != 0;
    const int64_t BSP = (BS + VL - 1) / VL * VL, hs = heads_per_pass(H / KVH, BF);
    const int64_t units = num_rows >= omp_get_num_threads() ? 1 : H / hs, span = H / units;
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t item = 0; item < num_rows * units; item++) {
        if (scratch == NULL) continue;  /* this thread's allocation failed: the caller reports it */
        const int64_t r = item / units, h0 = (item % units) * span, h1 = h0 + span;
        const int64_t L = row_ctx[r];
        const int64_t *table = block_tables + row_table[r] * max_blocks;
        const void *qr = at(q, r * q_row_stride, BF);
        void *o = at(out, r * H * D, BF);
        if (L == 0) { memset(at(o, h0 * D, BF), 0, (size_t)((h1 - h0) * D * (BF ? 2 : 4))); continue; }
        if (BF) attend_row_any(qr, o, k_cache, v_cache, table, scratch, L, H, KVH, D, h0, h1, BS, BSP, scale, 1);
        else attend_row_any(qr, o, k_cache, v_cache, table, scratch, L, H, KVH, D, h0, h1, BS, BSP, scale, 0);
    }
}

int paged_attention_rows(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                         const int64_t *block_tables, int64_t max_blocks, const int64_t *row_table,
                         const int64_t *row_ctx, void *out, int64_t num_rows, int64_t H, int64_t KVH, int64_t D,
                         int64_t BS, float scale, int64_t bf16) {
    // [ZH-START]
    // 入口（Python 侧 CpuAttentionKernel.__call__ 经 ctypes 调用）：
    // 1. head_dim 超过 256 返回 -2：这是和 Python 侧的约定（head_dim <= 256 才加载本内核），
    //    不是缓冲区的上限——临时区按 H、D 现算现分配（第 2 步）。
    // 2. 上下文总量（各行 L 之和 × H × D）不到 PARALLEL_MIN_WORK 时不起线程组，一个线程算完；
    //    否则每个 OpenMP 线程 malloc 一块临时区：qf、acc（各 H*D 个 float）、
    //    分数行 s（H * BSP，BSP 是块大小向上取整到向量宽度 VL）、m 和 l（各 H 个）；失败返回 -1。
    // 3. paged_attention_items 用 schedule(dynamic, 1) 分工作项（各行上下文长短不一）：
    //    行数不少于线程数时一项是一整行，否则一项是一行的一个 head（或共用 KV head 的一组）；
    //    第 r 行读 block_tables 的第 row_table[r] 行，上下文长度 L = row_ctx[r]；
    //    L == 0 时输出全零。这只是防御：CUDA 图不会走到 CPU 内核，
    //    CPU 上每行的上下文至少 1 个 token。
    // 4. 按 head_dim 选编译期特化的版本（64、128，其余走运行时长度），
    //    再按 bf16 标志选元素类型，调用 attend_row。
    // [ZH-END]
    if (D > 256) return -2;
    int64_t work = 0;
    for (int64_t r = 0; r < num_rows; r++) work += row_ctx[r];
    int failed = 0;
#pragma omp parallel reduction(| : failed) if (work * H * D >= PARALLEL_MIN_WORK)
    {
    float *scratch = (float *)malloc(sizeof(float) * (size_t)paged_attention_scratch(H, D, BS));
    failed = scratch == NULL;
    paged_attention_items(q, q_row_stride, k_cache, v_cache, block_tables, max_blocks, row_table, row_ctx, out,
                          num_rows, H, KVH, D, BS, scale, bf16, scratch);
    free(scratch);
    }
    return failed ? -1 : 0;
}

/* ------------------------------------------------------------------ prompt chunks
 *
 * One sequence's chunk of q_len new rows after num_cached cached tokens: row i attends to the
 * positions [0, num_cached + i]. paged_attention_rows would compute each row alone, reading and
 * widening its whole context again per row. Here the work is split into tiles of CHUNK_ROWS rows
 * times one KV head; a tile's query vectors (its rows times the G query heads sharing the KV head)
 * sit in the lanes of VL-wide vectors, VL query vectors to a lane group, with q stored transposed
 * ([D][VL] per group). Every K/V row of the context is then widened once per tile, and all the
 * arithmetic is lane-wise: a key's scores for a whole group are sum_d k[d] * qT[d] (k[d]
 * broadcast), the online softmax keeps one maximum and one sum per lane, and the output,
 * transposed the same way, is sum_i v_i[d] * p_i. No horizontal sums, no transposes of K or V;
 * eight keys (for scores) or eight output elements (for values) at a time make eight independent
 * FMA chains. The causal mask is a lane-wise compare of the key's position with each query
 * vector's context; keys no lane of a group can see are skipped. Summation orders differ from
 * paged_attention_rows, so the two agree to float rounding, not bit for bit.
 */

#define CHUNK_ROWS 64  /* query rows per tile */
#define KEYS 64        /* keys per key tile, at least (whole cache blocks) */
#define NB 8           /* keys scored, or output elements summed, together */

/* pT[i] = scale * (the scores of key rows kw[i] against the lane group's transposed queries qT),
 * for i < n (a multiple of NB). */
static inline void scores_lanes(const float *restrict qT, const float *restrict kw, float *restrict pT, int64_t n,
                                float scale, const int64_t D) {
    for (int64_t i0 = 0; i0 < n; i0 += NB) {
        vf acc[NB];
        for (int j = 0; j < NB; j++) acc[j] = (vf){0};
        for (int64_t d = 0; d < D; d++) {
            const vf qv = loadv(qT + d * VL);
            for (int j = 0; j < NB; j++) acc[j] += kw[(i0 + j) * D + d] * qv;
        }
        for (int j = 0; j < NB; j++) storev(pT + (i0 + j) * VL, acc[j] * scale);
    }
}

/* oT[d] = oT[d] * alpha + sum_i vw[i][d] * pT[i] over i < n, lane-wise, for every d < D. */
static inline void values_lanes(float *restrict oT, const float *restrict vw, const float *restrict pT, int64_t n,
                                vf alpha, const int64_t D) {
    const int64_t full = D - D % NB;
    for (int64_t d0 = 0; d0 < full; d0 += NB) {
        vf acc[NB];
        for (int j = 0; j < NB; j++) acc[j] = loadv(oT + (d0 + j) * VL) * alpha;
        for (int64_t i = 0; i < n; i++) {
            const vf p = loadv(pT + i * VL);
            for (int j = 0; j < NB; j++) acc[j] += vw[i * D + d0 + j] * p;
        }
        for (int j = 0; j < NB; j++) storev(oT + (d0 + j) * VL, acc[j]);
    }
    for (int64_t d0 = full; d0 < D; d0++) {
        vf acc = loadv(oT + d0 * VL) * alpha;
        for (int64_t i = 0; i < n; i++) acc += vw[i * D + d0] * loadv(pT + i * VL);
        storev(oT + d0 * VL, acc);
    }
}

static inline void chunk_tile(const void *q, int64_t q_row_stride, void *out, const void *k_cache, const void *v_cache,
                              const int64_t *table, int64_t num_cached, int64_t r0, int64_t nr, int64_t g,
                              float *scratch, int64_t H, int64_t KVH, int64_t BS, int64_t KT, float scale,
                              const int64_t D, const int BF) {
    // [ZH-START]
    // 一个 tile：第 r0 起的 nr 行 × 第 g 个 KV head，共 M = nr * G 个查询向量（行 i、
    // 组内 head j → m = i * G + j），每 VL 个放进一个“通道组”，向量 m 占第 m % VL 个通道。
    // 1. q 按组转置成 qT[D][VL]（不足 VL 的通道补零）；每个通道的可见上下文
    //    limit = num_cached + r0 + m / G + 1；每通道的运行最大值 -inf、exp 和 0，
    //    转置的累加器 oT[D][VL] 清零。
    // 2. tile 的上下文到最后一行的 limit（L）为止，每次取 KT 个 key（整块，至少 KEYS 个）：
    //    a. 这些 key 的 K、V 行（第 g 个 KV head）展开成 fp32 的 kw[i][D]、vw[i][D]，
    //       行数补到 NB 的倍数（补零）；tile 的所有通道组共用这一份，每个 tile 里 K/V
    //       每行只读、只展开一次；
    //    b. 对每个通道组：只看组里最后一个通道还看得见的前 nv 个 key（更靠后的整组跳过）；
    //       scores_lanes：每个 key 的分数是一个向量（每通道一个查询向量），
    //       Σ_d k[d] * qT[d]，每次 NB 个 key；
    //    c. 靠近对角线的 key 块：位置 >= 通道 limit 的通道置 -inf（因果掩码，按通道比较）；
    //    d. 逐通道 online softmax：新最大值、alpha = exp(旧 - 新)、p = exp(s - 新)（被掩的通道精确
    //       为 0），exp 和 = exp 和 * alpha + Σ p；全是按通道的向量运算，没有水平求和；
    //    e. values_lanes：oT[d] = oT[d] * alpha + Σ_i v_i[d] * p_i，每次 NB 个输出元素。
    // 3. 输出 out[行][head][d] = oT[d][通道] / exp 和，bf16 时这里才舍入一次。
    // [ZH-END]
    const int64_t G = H / KVH, row = KVH * D, M = nr * G, NG = (M + VL - 1) / VL;
    const int64_t KTP = (KT + NB - 1) / NB * NB;
    float *qT = scratch, *oT = qT + NG * D * VL, *mx = oT + NG * D * VL, *lsum = mx + NG * VL;
    float *kw = lsum + NG * VL, *vw = kw + KTP * D, *pT = vw + KTP * D;
    memset(qT, 0, sizeof(float) * NG * D * VL);
    memset(oT, 0, sizeof(float) * NG * D * VL);
    memset(lsum, 0, sizeof(float) * NG * VL);
    for (int64_t i = 0; i < NG * VL; i++) mx[i] = -INFINITY;
    for (int64_t m = 0; m < M; m++) {
        const int64_t src = (r0 + m / G) * q_row_stride + (g * G + m % G) * D;
        float *dst = qT + (m / VL) * D * VL + m % VL;
        for (int64_t d = 0; d < D; d++) dst[d * VL] = sload(q, src + d, BF);
    }
    const int64_t first = num_cached + r0 + 1, L = num_cached + r0 + nr;  /* contexts of the first and last row */
    for (int64_t t0 = 0; t0 < L; t0 += KT) {
        const int64_t n = (L - t0 < KT) ? L - t0 : KT;
        for (int64_t i = 0; i < n; i++) {
            const int64_t t = t0 + i, src = table[t / BS] * BS * row + (t % BS) * row + g * D;
            int64_t d = 0;
            for (; d + VL <= D; d += VL) {
                storev(kw + i * D + d, vload(k_cache, src + d, BF));
                storev(vw + i * D + d, vload(v_cache, src + d, BF));
            }
            for (; d < D; d++) {
                kw[i * D + d] = sload(k_cache, src + d, BF);
                vw[i * D + d] = sload(v_cache, src + d, BF);
            }
        }
        memset(kw + n * D, 0, sizeof(float) * (KTP - n) * D);
        for (int64_t grp = 0; grp < NG; grp++) {
            const int64_t last = grp * VL + VL - 1 < M ? grp * VL + VL - 1 : M - 1;  /* its last query vector */
            const int64_t seen = first + last / G - t0, nv = seen >= n ? n : seen;  /* keys its lanes can see */
            if (nv <= 0) continue;
            float *qg = qT + grp * D * VL, *og = oT + grp * D * VL;
            scores_lanes(qg, kw, pT, (nv + NB - 1) / NB * NB, scale, D);
            vi limit;  /* each lane's context: query vector m = grp * VL + lane (padding lanes: the last one's) */
            for (int j = 0; j < VL; j++) limit[j] = (int32_t)(first + (grp * VL + j < M ? grp * VL + j : last) / G);
            const vf m_old = loadv(mx + grp * VL);
            vf m_new = m_old;
            const int masked = t0 + nv > first + (grp * VL) / G;  /* some key here is past some lane's context */
            for (int64_t i = 0; i < nv; i++) {
                vf x = loadv(pT + i * VL);
                if (masked) {
                    x = vselect(limit > (vi){0} + (int32_t)(t0 + i), x, (vf){0} - INFINITY);
                    storev(pT + i * VL, x);
                }
                m_new = vselect(x > m_new, x, m_new);
            }
            const vf alpha = vexp(m_old - m_new);
            vf sum = {0};
            for (int64_t i = 0; i < nv; i++) {
                const vf x = loadv(pT + i * VL);
                const vf p = vselect(x > (vf){0} - INFINITY, vexp(x - m_new), (vf){0});
                storev(pT + i * VL, p);
                sum += p;
            }
            storev(mx + grp * VL, m_new);
            storev(lsum + grp * VL, loadv(lsum + grp * VL) * alpha + sum);
            values_lanes(og, vw, pT, nv, alpha, D);
        }
    }
    for (int64_t m = 0; m < M; m++) {
        const float *og = oT + (m / VL) * D * VL + m % VL;
        const float inv = 1.f / lsum[m];
        void *dst = at(out, (r0 + m / G) * H * D + (g * G + m % G) * D, BF);
        for (int64_t d = 0; d < D; d++) sstore(dst, d, og[d * VL] * inv, BF);
    }
}

int paged_attention_chunk(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                          const int64_t *block_table, int64_t num_cached, int64_t q_len, void *out, int64_t H,
                          int64_t KVH, int64_t D, int64_t BS, float scale, int64_t bf16) {
    // [ZH-START]
    // 入口（CpuAttentionKernel.chunk 经 ctypes 调用）：一条序列的一个 prefill 分块。
    // 1. 工作项 = 行 tile（每 CHUNK_ROWS 行一个）× KV head；因果注意力下靠后的 tile 上下文更长，
    //    所以从最后一个 tile 开始分发（schedule(dynamic, 1)），大的先做，线程间更均衡。
    // 2. key tile 取整块：KT = 块大小的整数倍，至少 KEYS 个 key。
    // 3. 每个 OpenMP 线程 malloc 一块临时区（qT、oT、每通道最大值和 exp 和、kw、
    //    vw、pT）；失败返回 -1。
    // 4. 按 head_dim 选编译期特化（64、128，其余运行时），
    //    再按 bf16 标志选元素类型，调用 chunk_tile。
    // [ZH-END]
    if (D > 256) return -2;
    const int64_t G = H / KVH, KT = (KEYS + BS - 1) / BS * BS, KTP = (KT + NB - 1) / NB * NB;
    const int64_t NG = (CHUNK_ROWS * G + VL - 1) / VL, tiles = (q_len + CHUNK_ROWS - 1) / CHUNK_ROWS;
    const size_t floats = 2 * NG * D * VL + 2 * NG * VL + 2 * KTP * D + KTP * VL;
    const int BF = bf16 != 0;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
    float *scratch = (float *)malloc(sizeof(float) * floats);
    failed = scratch == NULL;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < tiles * KVH; item++) {
        if (failed) continue;
        const int64_t r0 = (tiles - 1 - item / KVH) * CHUNK_ROWS, g = item % KVH;
        const int64_t nr = q_len - r0 < CHUNK_ROWS ? q_len - r0 : CHUNK_ROWS;
#define TILE(DD, B) chunk_tile(q, q_row_stride, out, k_cache, v_cache, block_table, num_cached, r0, nr, g, scratch, \
                               H, KVH, BS, KT, scale, DD, B)
        if (D == 64) { if (BF) TILE(64, 1); else TILE(64, 0); }
        else if (D == 128) { if (BF) TILE(128, 1); else TILE(128, 0); }
        else { if (BF) TILE(D, 1); else TILE(D, 0); }
#undef TILE
    }
    free(scratch);
    }
    return failed ? -1 : 0;
}
