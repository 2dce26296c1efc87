/* SIMD helpers shared by the CPU kernels: eight-lane float vectors as GCC/Clang vector
 * extensions, which compile to straight-line SIMD code on any target (AVX2 here). */
#ifndef NANOVLLM_CPU_SIMD_H
#define NANOVLLM_CPU_SIMD_H

#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

/* Eight floats from / to memory of any alignment. */
static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

/* exp(x) of eight lanes for x in [-87, 88] (clamped there), as 2^n * e^r with |r| <= ln2/2 and a
 * degree-7 polynomial for e^r: within an ulp or two of expf. */
static inline v8f exp8(v8f x) {
    const v8f lo = {-87.f, -87.f, -87.f, -87.f, -87.f, -87.f, -87.f, -87.f};
    const v8f hi = {88.f, 88.f, 88.f, 88.f, 88.f, 88.f, 88.f, 88.f};
    const v8i below = x < lo, above = x > hi;  /* lanes of all ones where out of range */
    x = (v8f)(((v8i)x & ~below) | ((v8i)lo & below));
    x = (v8f)(((v8i)x & ~above) | ((v8i)hi & above));
    const v8f n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  /* round to nearest */
    const v8f r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
    v8f p = r * (1.f / 5040.f) + 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
    return p * (v8f)bits;
}

static inline float hsum8(v8f v) {
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

#endif
