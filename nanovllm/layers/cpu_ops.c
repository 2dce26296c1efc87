/* The decoder's elementwise work on CPU, fused: one pass over each row instead of a chain of
 * torch ops (each a dispatch, an allocation and a pass over memory, most of them single-threaded
 * at decode sizes). Same formulas as the torch modules they replace, and in bf16 the same
 * roundings (torch rounds every op's result to bf16; `sround`/`vround` mark where):
 *   rms_norm:        out = w * bf16(x * 1/sqrt(mean(x^2) + eps)), after residual += x when given;
 *   qk_norm_rope:    per-head RMSNorm of q and k (Qwen3), rotary embedding ("rotate half",
 *                    bf16(x1 * cos) - bf16(x2 * sin) ...), then K and V rows stored into the
 *                    paged cache;
 *   silu_mul:        out = bf16(silu(gate)) * up, silu(g) = g / (1 + exp(-g)).
 * Every entry point takes `bf16` (0: float32 tensors, 1: bfloat16 tensors, weights and tables
 * included) and runs the same body compiled for that element type (cpu_simd.h).
 * Rows are spread over torch's OpenMP threads (see cpu_attention.c) when there is enough work.
 */
// [ZH-START]
// 本文件在整体架构中的位置：CPU 路径上解码器的逐元素运算，融合成每行一次遍历。
//   Attention.forward ─qk_norm_rope_store→ q/k norm + 旋转 + 把 K/V 写进分页 cache
//                     （KV 写入就在这里）
//                     → cpu_attention.c 的 paged_attention_rows / chunk 沿块表读回这些槽位
//   RMSNorm.add_and_norm ─rms_norm→ 残差相加 + 归一化；MLP ─silu_mul→ SiLU(gate) × up
// 公式与被替换的 torch 模块相同；bf16 下舍入位置也相同（torch 每个算子的结果都舍入到 bf16，
// 这里用 sround / vround 标出对应的位置）。
// [ZH-END]
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_simd.h"

static inline float inv_rms(const void *x, int64_t n, float eps, const int BF) {
    vf a = {0}, b = {0};
    int64_t i = 0;
    for (; i + 2 * VL <= n; i += 2 * VL) {
        const vf x0 = vload(x, i, BF), x1 = vload(x, i + VL, BF);
        a += x0 * x0;
        b += x1 * x1;
    }
    float sum = hsum(a + b);
    for (; i < n; i++) {
        const float xi = sload(x, i, BF);
        sum += xi * xi;
    }
    return 1.f / sqrtf(sum / (float)n + eps);
}

/* y = w * bf16(x * inv) over n elements; y may be x. */
static inline void scale_by_weight(const void *x, float inv, const void *w, void *y, int64_t n, const int BF) {
    int64_t i = 0;
    for (; i + VL <= n; i += VL) vstore(y, i, vload(w, i, BF) * vround(vload(x, i, BF) * inv, BF), BF);
    for (; i < n; i++) sstore(y, i, sload(w, i, BF) * sround(sload(x, i, BF) * inv, BF), BF);
}

/* One row: out = w * norm(x), after residual += x (residual nullable; then x is normalised). */
static inline void rms_norm_row(const void *xr, void *res, const void *w, void *out, int64_t dim, float eps,
                                const int BF) {
    if (res != NULL) {
        int64_t i = 0;
        for (; i + VL <= dim; i += VL) vstore(res, i, vload(res, i, BF) + vload(xr, i, BF), BF);
        for (; i < dim; i++) sstore(res, i, sload(res, i, BF) + sload(xr, i, BF), BF);
        xr = res;  /* normalise the sum as stored (rounded, in bf16) */
    }
    scale_by_weight(xr, inv_rms(xr, dim, eps, BF), w, out, dim, BF);
}

static inline void rms_norm_rows(const void *x, int64_t x_stride, void *residual, const void *w, void *out,
                                 int64_t rows, int64_t dim, float eps, const int BF) {
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++)
        rms_norm_row(at(x, r * x_stride, BF), residual != NULL ? at(residual, r * dim, BF) : NULL, w,
                     at(out, r * dim, BF), dim, eps, BF);
}

/* residual (nullable): residual += x first, and normalise that. x rows are x_stride elements
 * apart; residual and out rows are dim elements apart. */
void rms_norm(const void *x, int64_t x_stride, void *residual, const void *w, void *out, int64_t rows,
              int64_t dim, float eps, int64_t bf16) {
    if (bf16) rms_norm_rows(x, x_stride, residual, w, out, rows, dim, eps, 1);
    else rms_norm_rows(x, x_stride, residual, w, out, rows, dim, eps, 0);
}

/* rms_norm by this thread alone, never starting threads (a caller already runs its own team). */
void rms_norm_serial(const void *x, int64_t x_stride, void *residual, const void *w, void *out, int64_t rows,
                     int64_t dim, float eps, int64_t bf16) {
    for (int64_t r = 0; r < rows; r++) {
        void *res = residual != NULL ? (char *)residual + r * dim * (bf16 ? 2 : 4) : NULL;
        if (bf16) rms_norm_row(at(x, r * x_stride, 1), res, w, at(out, r * dim, 1), dim, eps, 1);
        else rms_norm_row(at(x, r * x_stride, 0), res, w, at(out, r * dim, 0), dim, eps, 0);
    }
}

/* One head in place: optional RMSNorm (weight w), then the rotary embedding with cos/sin of
 * half the head size. */
static inline void norm_rope_head(void *x, const void *w, float eps, const void *c, const void *s, int64_t D,
                                  const int BF) {
    if (w != NULL) scale_by_weight(x, inv_rms(x, D, eps, BF), w, x, D, BF);
    const int64_t half = D / 2;
    int64_t i = 0;
    for (; i + VL <= half; i += VL) {
        const vf x1 = vload(x, i, BF), x2 = vload(x, i + half, BF), cv = vload(c, i, BF), sv = vload(s, i, BF);
        vstore(x, i, vround(x1 * cv, BF) - vround(x2 * sv, BF), BF);
        vstore(x, i + half, vround(x2 * cv, BF) + vround(x1 * sv, BF), BF);
    }
    for (; i < half; i++) {
        const float x1 = sload(x, i, BF), x2 = sload(x, i + half, BF), ci = sload(c, i, BF), si = sload(s, i, BF);
        sstore(x, i, sround(x1 * ci, BF) - sround(x2 * si, BF), BF);
        sstore(x, i + half, sround(x2 * ci, BF) + sround(x1 * si, BF), BF);
    }
}

static inline void qk_norm_rope_store_rows(void *qkv, int64_t rows, int64_t row_stride, int64_t H, int64_t KVH,
                                           int64_t D, const void *q_w, const void *k_w, float eps,
                                           const void *cos_cache, const void *sin_cache, const int64_t *positions,
                                           void *k_cache, void *v_cache, const int64_t *slots, const int BF) {
    // [ZH-START]
    // 每行（一个 token）：
    // 1. 按 positions[r] 取 cos / sin 表的那一行（各 D/2 个）。
    // 2. H 个 query 头、KVH 个 key 头各自原地做 RMSNorm（给了权重时，Qwen3）
    //    和旋转（"rotate half"）。
    // 3. slots[r] >= 0 时，把这一行的 K、V（各 KVH × D 个元素）memcpy 到 cache 的第 slots[r]
    //    个槽位；槽位为负的行跳过。cache 布局是 [槽位, KVH, D]，
    //    槽位 = 物理块号 × block_size + 块内偏移。
    // 行数 × 行宽够大时才按行分给 OpenMP 线程，否则 fork/join 得不偿失。
    // [ZH-END]
    const int64_t half = D / 2, kv_bytes = KVH * D * (BF ? 2 : 4);
#pragma omp parallel for schedule(static) if (rows * row_stride >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        void *row = at(qkv, r * row_stride, BF);
        const void *c = at(cos_cache, positions[r] * half, BF), *s = at(sin_cache, positions[r] * half, BF);
        for (int64_t h = 0; h < H; h++) norm_rope_head(at(row, h * D, BF), q_w, eps, c, s, D, BF);
        void *k = at(row, H * D, BF), *v = at(k, KVH * D, BF);
        for (int64_t h = 0; h < KVH; h++) norm_rope_head(at(k, h * D, BF), k_w, eps, c, s, D, BF);
        if (slots[r] >= 0) {
            memcpy(at(k_cache, slots[r] * KVH * D, BF), k, kv_bytes);
            memcpy(at(v_cache, slots[r] * KVH * D, BF), v, kv_bytes);
        }
    }
}

/* qkv rows hold H query heads, then KVH key heads, then KVH value heads, row_stride elements
 * apart. q and k are normalised (when q_w / k_w are given) and rotated in place; each row's K and
 * V are copied into the caches ([slots, KVH, D]) at slots[r], skipped where the slot is negative.
 * The cos/sin tables are (positions, D/2) in the tensors' dtype. */
void qk_norm_rope_store(void *qkv, int64_t rows, int64_t row_stride, int64_t H, int64_t KVH, int64_t D,
                        const void *q_w, const void *k_w, float eps, const void *cos_cache, const void *sin_cache,
                        const int64_t *positions, void *k_cache, void *v_cache, const int64_t *slots, int64_t bf16) {
    if (bf16)
        qk_norm_rope_store_rows(qkv, rows, row_stride, H, KVH, D, q_w, k_w, eps, cos_cache, sin_cache, positions,
                                k_cache, v_cache, slots, 1);
    else
        qk_norm_rope_store_rows(qkv, rows, row_stride, H, KVH, D, q_w, k_w, eps, cos_cache, sin_cache, positions,
                                k_cache, v_cache, slots, 0);
}

/* Head u of every row alone (u < H: query head u; then the KVH key heads; then the KVH value
 * heads): what qk_norm_rope_store does to that head, by this thread, so that a caller can give
 * each head to the thread that computed its projection (cpu_decode.c). */
void qk_norm_rope_store_head(void *qkv, int64_t rows, int64_t row_stride, int64_t u, int64_t H, int64_t KVH,
                             int64_t D, const void *q_w, const void *k_w, float eps, const void *cos_cache,
                             const void *sin_cache, const int64_t *positions, void *k_cache, void *v_cache,
                             const int64_t *slots, int64_t bf16) {
    const int BF = bf16 != 0;
    const int64_t half = D / 2, g = u - H < KVH ? u - H : u - H - KVH; /* the KV head, for u >= H */
    for (int64_t r = 0; r < rows; r++) {
        void *head = at(qkv, r * row_stride + u * D, BF);
        if (u < H + KVH) {
            const void *c = at(cos_cache, positions[r] * half, BF), *s = at(sin_cache, positions[r] * half, BF);
            if (BF) norm_rope_head(head, u < H ? q_w : k_w, eps, c, s, D, 1);
            else norm_rope_head(head, u < H ? q_w : k_w, eps, c, s, D, 0);
        }
        if (u >= H && slots[r] >= 0)
            memcpy(at(u < H + KVH ? k_cache : v_cache, slots[r] * KVH * D + g * D, BF), head, (size_t)(D * (BF ? 2 : 4)));
    }
}

static inline void silu_mul_row(const void *g, void *o, int64_t inter, const int BF) {
    const void *u = at(g, inter, BF);
    int64_t i = 0;
    for (; i + VL <= inter; i += VL) {
        const vf gv = vload(g, i, BF);
        vstore(o, i, vround(gv / (1.f + vexp(-gv)), BF) * vload(u, i, BF), BF);
    }
    for (; i < inter; i++) {
        const float gi = sload(g, i, BF);
        sstore(o, i, sround(gi / (1.f + expf(-gi)), BF) * sload(u, i, BF), BF);
    }
}

static inline void silu_mul_rows(const void *gate_up, void *out, int64_t rows, int64_t inter, const int BF) {
#pragma omp parallel for schedule(static) if (rows * inter >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) silu_mul_row(at(gate_up, r * 2 * inter, BF), at(out, r * inter, BF), inter, BF);
}

/* gate_up rows are [gate (inter) | up (inter)]; out rows are inter elements. */
void silu_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int64_t bf16) {
    if (bf16) silu_mul_rows(gate_up, out, rows, inter, 1);
    else silu_mul_rows(gate_up, out, rows, inter, 0);
}

/* silu_mul by this thread alone, never starting threads. */
void silu_mul_serial(const void *gate_up, void *out, int64_t rows, int64_t inter, int64_t bf16) {
    for (int64_t r = 0; r < rows; r++) {
        if (bf16) silu_mul_row(at(gate_up, r * 2 * inter, 1), at(out, r * inter, 1), inter, 1);
        else silu_mul_row(at(gate_up, r * 2 * inter, 0), at(out, r * inter, 0), inter, 0);
    }
}
