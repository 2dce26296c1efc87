/* The sampler's draw on CPU (layers/sampling_ops.py `draw`, for rows without top-k/top-p/min-p):
 * one token per row with probability softmax(row / temperature), by inverse CDF against the
 * row's one uniform number. torch needs six passes over (R, V) for it, the float64 cumsum alone
 * single-threaded and ~30 ms at 64 x 49152 here; this is two to three passes a row, rows spread
 * over the OpenMP threads.
 *
 * Per row: m = max; w_i = exp((x_i - m) / t), 0 where (x_i - m) / t < -87 (masked -inf logits
 * included: exp would give 0 or a denormal there, which cannot move the draw); total = the sum
 * of w in blocks of VL lanes, each block summed in float and added to a double; u = (1 - uniform)
 * * total, in (0, total]; then the same blocks are summed again in the same order until the
 * running double sum reaches u, and inside that block element by element. The index chosen has
 * a positive weight; where rounding leaves the block's element sum short of u, the block's last
 * positive weight is taken. The float arithmetic before exp is torch's ((x - m) rounded, then
 * divided by t), exp is `vexp` (within an ulp or two of expf), so only a u within a few ulps
 * of a cumulative boundary can pick the neighbour torch would pick.
 */
// [ZH-START]
// 本文件在整体架构中的位置：采样器在 CPU 上的逆 CDF 抽样（没有 top_k/top_p/min_p 的行），
//   Sampler._choose → sample_rows → CpuOps.draw → draw_rows（本文件），每行一个均匀随机数。
// 每行：求最大值 m；权重 w = exp((x - m) / t)，(x - m) / t < -87 处记 0（被屏蔽的 -inf 也在此）；
// 按 VL 个一块求和（块内 float，块间 double）得 total；u = (1 - uniform) × total；
// 再按同样的块顺序累加到 ≥ u，在那一块里逐个找到第一个使累加和 ≥ u 的位置，它的权重一定为正。
// torch 要六遍 (R, V)，其中 float64 的 cumsum 单线程；这里每行两到三遍，行分给 OpenMP 线程。
// mask_rows_bits：只有语法约束的行直接用 llguidance 打包的允许位屏蔽（每 32 个 token 一个字，
//   全 0 的字整段写 -inf，全 1 的跳过），不再解包成 (G, V) 的 bool 再 masked_fill_；
//   n_vocab 之后（logits 比词表宽）一律 -inf。
//   调用方：constraints.mask_grammar_rows → CpuOps.mask_bits。
// [ZH-END]
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_simd.h"

#define UNDERFLOW (-87.f)        /* exp below this is < 1.7e-38 of the row's largest weight */

static inline vf block_weights(const float *x, float m, float t) {
    const vf s = (loadv(x) - m) / t;
    return vselect(s < UNDERFLOW, (vf){}, vexp(s));
}

static inline float scalar_weight(float x, float m, float t) {
    const float s = (x - m) / t;
    return s < UNDERFLOW ? 0.f : expf(s);
}

static inline float row_max(const float *x, int64_t n) {
    int64_t i = 0;
    float m = -INFINITY;
    if (n >= VL) {
        vf mv = loadv(x);
        for (i = VL; i + VL <= n; i += VL) {
            const vf v = loadv(x + i);
            mv = vselect(v > mv, v, mv);
        }
        for (int l = 0; l < VL; l++) m = mv[l] > m ? mv[l] : m;
    }
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* Sum of the weights of x[0, n): each whole block's float sum kept in `sums`, then the tail. */
static inline double row_total(const float *x, int64_t n, float m, float t, float *sums) {
    double total = 0.0;
    int64_t i = 0, b = 0;
    for (; i + VL <= n; i += VL, b++) total += (sums[b] = hsum(block_weights(x + i, m, t)));
    for (; i < n; i++) total += scalar_weight(x[i], m, t);
    return total;
}

/* The first index whose running weight sum reaches u (0 < u <= total), the blocks' sums added in
 * `row_total`'s order, so the running sum reaches the total exactly at the end. */
static inline int64_t pick(const float *x, int64_t n, float m, float t, const float *sums, double u) {
    double cum = 0.0;
    int64_t i = 0, b = 0, last = -1;
    for (; i + VL <= n; i += VL, b++) {
        if (sums[b] > 0.f && cum + sums[b] >= u) {
            const vf w = block_weights(x + i, m, t);
            for (int l = 0; l < VL; l++) {
                if (w[l] > 0.f) {
                    cum += w[l];
                    last = i + l;
                    if (cum >= u) return last;
                }
            }
            return last;  /* rounding left the lanes' sum just short of u: the block's last weight */
        }
        cum += sums[b];
    }
    for (; i < n; i++) {
        const float w = scalar_weight(x[i], m, t);
        if (w > 0.f) {
            cum += w;
            last = i;
            if (cum >= u) return i;
        }
    }
    if (last >= 0) return last;
    /* Not reached (u rounded above the sum: not expected, as u <= total): the last positive weight. */
    for (b = n / VL - 1; b >= 0; b--) {
        if (sums[b] > 0.f) {
            const vf w = block_weights(x + b * VL, m, t);
            for (int l = VL - 1; l >= 0; l--)
                if (w[l] > 0.f) return b * VL + l;
        }
    }
    return -1;
}

/* logits (rows, n) float32 with row stride `stride`; temperature (rows,) float32 > 0; uniform
 * (rows,) float64 in [0, 1); out (rows,) int64. A row whose maximum is not finite (all -inf,
 * +inf) or whose weights do not sum to [1, n] (a NaN) gets -1. */
void draw_rows(const float *logits, int64_t stride, int64_t rows, int64_t n, const float *temperature,
                  const double *uniform, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * stride;
        const float m = row_max(x, n);
        if (!isfinite(m)) {
            out[r] = -1;
            continue;
        }
        const float t = temperature[r];
        float sums[n / VL + 1];  /* the row's block sums: 12 KB for a 49152-token vocabulary */
        const double total = row_total(x, n, m, t, sums);
        if (!(total >= 1.0 && total <= (double)n)) {  /* NaN among the logits, or t not > 0 */
            out[r] = -1;
            continue;
        }
        out[r] = pick(x, n, m, t, sums, (1.0 - uniform[r]) * total);
    }
}

/* A grammar's packed token mask applied to logits rows in place: the rows `rows[g]` of logits
 * (stride `stride`, `width` entries each) get -inf wherever bit t of `bits` row g (32 tokens a
 * 32-bit word, token t at bit t % 32 of word t / 32: llguidance's bitmask, `bits_stride` words a
 * row) is 0, and from `n_vocab` on (logits wider than the grammar's vocabulary). Instead of
 * unpacking the bits into a (G, V) bool tensor and a masked_fill_ over it: a word of 32
 * blocked tokens (most words, under a grammar) is one run of stores, an all-allowed word is
 * skipped. */
void mask_rows_bits(float *logits, int64_t stride, const int64_t *rows, int64_t count, int64_t width,
                    const int32_t *bits, int64_t bits_stride, int64_t n_vocab) {
    const int64_t covered = n_vocab < width ? n_vocab : width;
#pragma omp parallel for schedule(static) if (count * width >= PARALLEL_MIN_ELEMS)
    for (int64_t g = 0; g < count; g++) {
        float *x = logits + rows[g] * stride;
        const uint32_t *b = (const uint32_t *)(bits + g * bits_stride);
        int64_t t = 0;
        for (; t + 32 <= covered; t += 32) {
            const uint32_t word = b[t / 32];
            if (word == 0xffffffffu) continue;
            if (word == 0) {
                for (int i = 0; i < 32; i++) x[t + i] = -INFINITY;
                continue;
            }
            for (uint32_t blocked = ~word; blocked; blocked &= blocked - 1) x[t + __builtin_ctz(blocked)] = -INFINITY;
        }
        for (; t < covered; t++)
            if (!((b[t / 32] >> (t % 32)) & 1u)) x[t] = -INFINITY;
        for (; t < width; t++) x[t] = -INFINITY;
    }
}
