/* The decoder's elementwise work on CPU, fused: one pass over each row instead of a chain of
 * torch ops (each a dispatch, an allocation and a pass over memory, most of them single-threaded
 * at decode sizes). Same formulas and float order as the torch modules they replace:
 *   rms_norm:        out = w * (x * 1/sqrt(mean(x^2) + eps)), after residual += x when given;
 *   qk_norm_rope:    per-head RMSNorm of q and k (Qwen3), rotary embedding ("rotate half"),
 *                    then K and V rows stored into the paged cache;
 *   silu_mul:        out = silu(gate) * up, silu(g) = g / (1 + exp(-g)).
 * Rows are spread over torch's OpenMP threads (see cpu_attention.c) when there is enough work.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_simd.h"

#define PARALLEL_MIN_FLOATS 32768 /* below this, a fork/join costs more than it saves */

static inline float inv_rms(const float *x, int64_t n, float eps) {
    v8f a = {0}, b = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const v8f x0 = load8(x + i), x1 = load8(x + i + 8);
        a += x0 * x0;
        b += x1 * x1;
    }
    float sum = hsum8(a + b);
    for (; i < n; i++) sum += x[i] * x[i];
    return 1.f / sqrtf(sum / (float)n + eps);
}

/* y = w * (x * inv) over n floats; y may be x. */
static inline void scale_by_weight(const float *x, float inv, const float *w, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) store8(y + i, load8(w + i) * (load8(x + i) * inv));
    for (; i < n; i++) y[i] = w[i] * (x[i] * inv);
}

/* residual (nullable): residual += x first, and normalise that. x rows are x_stride floats apart;
 * residual and out rows are dim floats apart. */
void rms_norm_f32(const float *x, int64_t x_stride, float *residual, const float *w, float *out, int64_t rows,
                  int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        if (residual != NULL) {
            float *res = residual + r * dim;
            int64_t i = 0;
            for (; i + 8 <= dim; i += 8) store8(res + i, load8(res + i) + load8(xr + i));
            for (; i < dim; i++) res[i] = res[i] + xr[i];
            xr = res;
        }
        scale_by_weight(xr, inv_rms(xr, dim, eps), w, out + r * dim, dim);
    }
}

/* One head in place: optional RMSNorm (weight w), then the rotary embedding with cos/sin of
 * half the head size. */
static inline void norm_rope_head(float *x, const float *w, float eps, const float *c, const float *s,
                                  int64_t D) {
    if (w != NULL) scale_by_weight(x, inv_rms(x, D, eps), w, x, D);
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] - x2 * s[i];
        x[i + half] = x2 * c[i] + x1 * s[i];
    }
}

/* qkv rows hold H query heads, then KVH key heads, then KVH value heads, row_stride floats apart.
 * q and k are normalised (when q_w / k_w are given) and rotated in place; each row's K and V are
 * copied into the caches ([slots, KVH, D]) at slots[r], skipped where the slot is negative. */
void qk_norm_rope_store_f32(float *qkv, int64_t rows, int64_t row_stride, int64_t H, int64_t KVH, int64_t D,
                            const float *q_w, const float *k_w, float eps, const float *cos_cache,
                            const float *sin_cache, const int64_t *positions, float *k_cache, float *v_cache,
                            const int64_t *slots) {
    const int64_t half = D / 2;
#pragma omp parallel for schedule(static) if (rows * row_stride >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        float *row = qkv + r * row_stride;
        const float *c = cos_cache + positions[r] * half, *s = sin_cache + positions[r] * half;
        for (int64_t h = 0; h < H; h++) norm_rope_head(row + h * D, q_w, eps, c, s, D);
        float *k = row + H * D, *v = k + KVH * D;
        for (int64_t h = 0; h < KVH; h++) norm_rope_head(k + h * D, k_w, eps, c, s, D);
        if (slots[r] >= 0) {
            memcpy(k_cache + slots[r] * KVH * D, k, sizeof(float) * KVH * D);
            memcpy(v_cache + slots[r] * KVH * D, v, sizeof(float) * KVH * D);
        }
    }
}

/* gate_up rows are [gate (inter) | up (inter)]; out rows are inter floats. */
void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows * inter >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        int64_t i = 0;
        for (; i + 8 <= inter; i += 8) {
            const v8f gv = load8(g + i);
            store8(o + i, gv / (1.f + exp8(-gv)) * load8(u + i));
        }
        for (; i < inter; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}
