/* SIMD helpers shared by the CPU kernels, as GCC/Clang vector extensions: the compiler turns them
 * into straight-line SIMD code for the CPU the library is built on (-march=native).
 *
 * - `vf`: VL float lanes, the widest the CPU has: 16 (one zmm register) with AVX-512, 8 (ymm)
 *   with AVX2. Kernels written against `vf` and `VL` are one source for both.
 * - `v8f`: always eight lanes, for code laid out around eight-wide steps.
 * - Element types: each kernel body takes a compile-time flag `BF` (0: float32, 1: bfloat16) and
 *   reads and writes memory through `vload`/`vstore`/`sload`/`sstore`, which convert to and from
 *   float lanes. All arithmetic is float; bf16 stores round to nearest even. `vround`/`sround`
 *   round an intermediate to bf16 where the reference (torch in bf16) rounds it, and do nothing
 *   in float32, so one body computes both dtypes exactly as the torch modules do.
 */
#ifndef NANOVLLM_CPU_SIMD_H
#define NANOVLLM_CPU_SIMD_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif

#define PARALLEL_MIN_ELEMS 32768 /* elements of a row-wise op below which a fork/join costs more than it saves */

typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
typedef uint16_t vh __attribute__((vector_size(VL * 2)));
typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

/* ---- float32 lanes from / to memory of any alignment */

static inline vf loadv(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void storev(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline v8f load8(const float *p) { v8f v; memcpy(&v, p, sizeof v); return v; }

/* ---- bfloat16: the top half of a float32. Rounding to nearest even, NaN kept a (quiet) NaN. */

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t bf16_round_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u | 0x00400000u) & 0xffff0000u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
}

static inline uint16_t f32_to_bf16(float f) { return (uint16_t)(bf16_round_bits(f) >> 16); }

static inline float sround_bf16(float f) {
    const uint32_t u = bf16_round_bits(f);
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline vu vround_bits(vf x) {
    const vu u = (vu)x;
    const vu nan = (vu)((vi)(u & 0x7fffffffu) > (vi){} + 0x7f800000);  /* all ones in NaN lanes */
    const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    return (rounded & ~nan) | (((u | 0x00400000u) & 0xffff0000u) & nan);
}

static inline vf loadv_bf16(const uint16_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}

static inline void storev_bf16(uint16_t *p, vf x) {
    const vh h = __builtin_convertvector(vround_bits(x) >> 16, vh);
    memcpy(p, &h, sizeof h);
}

static inline v8f load8_bf16(const uint16_t *p) {
    v8h h;
    memcpy(&h, p, sizeof h);
    return (v8f)(__builtin_convertvector(h, v8u) << 16);
}

/* ---- one body for both element types: BF is a compile-time constant at every call */

static inline void *at(const void *p, int64_t i, const int BF) { return (char *)p + i * (BF ? 2 : 4); }

static inline vf vload(const void *p, int64_t i, const int BF) {
    return BF ? loadv_bf16((const uint16_t *)p + i) : loadv((const float *)p + i);
}

static inline void vstore(void *p, int64_t i, vf v, const int BF) {
    if (BF) storev_bf16((uint16_t *)p + i, v);
    else storev((float *)p + i, v);
}

static inline v8f load8x(const void *p, int64_t i, const int BF) {
    return BF ? load8_bf16((const uint16_t *)p + i) : load8((const float *)p + i);
}

static inline float sload(const void *p, int64_t i, const int BF) {
    return BF ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void sstore(void *p, int64_t i, float v, const int BF) {
    if (BF) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

static inline vf vround(vf x, const int BF) { return BF ? (vf)vround_bits(x) : x; }
static inline float sround(float x, const int BF) { return BF ? sround_bf16(x) : x; }

/* ---- math */

/* a where mask lanes are all ones, b where zero */
static inline vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* exp(x) per lane for x in [-87, 88] (clamped there), as 2^n * e^r with |r| <= ln2/2 and a
 * degree-7 polynomial for e^r: within an ulp or two of expf. */
static inline vf vexp(vf x) {
    x = vselect(x < -87.f, (vf){} - 87.f, x);
    x = vselect(x > 88.f, (vf){} + 88.f, x);
    const vf n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  /* round to nearest */
    const vf r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
    vf p = r * (1.f / 5040.f) + 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    return p * (vf)bits;
}

static inline float hsum(vf v) {
    float s = 0.f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

#endif
