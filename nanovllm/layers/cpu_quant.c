/* Matrix products with weights kept packed (quantized) in memory, on CPU.
 *
 * Two layouts serve every packed GGUF type (layers/quant.py maps them):
 *   4-bit: codes uint8 [N, K/2], per group of 32 inputs 16 bytes, byte j holding element j (low
 *          nibble) and element j+16 (high nibble), as GGUF's Q4_0/Q4_1 blocks do;
 *          w = scale * q + min, q in 0..15.
 *   8-bit: codes int8 [N, K]; w = scale * q (+ min where mins are given); groups of 16 or 32.
 * Scales and mins are float16 [N, K / group].
 *
 * quant_matmul: y (M, N) = x (M, K) W^T. Each row of x is quantized to int8 per 32 inputs
 * (scale amax/127), as llama.cpp does, so a group's dot product is one integer dot product
 * (AVX2 maddubs, or VNNI dpbusd where the CPU has it) times the two scales, plus min * sum(x).
 * Each weight group is loaded once for up to four rows of x: this is the path for small M, where
 * the weight bytes are the cost. Large M goes through quant_dequant into a float panel and the
 * float GEMM instead (layers/quant.py picks).
 * quant_dequant: rows of W as float32 or bfloat16 (`bf16`), for that panel and the embedding.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define QUANT_AVX2 1
#endif

#define QK 32            /* inputs per activation block */
#define ROWS_PER_PASS 4  /* rows of x sharing one load of a weight group */

static inline float f16_to_f32(uint16_t h) {
#ifdef QUANT_AVX2
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        float f = ldexpf((float)mant, -24);
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* One row of x quantized per block of 32: codes, the block's scale, and scale * sum(codes) of
 * each half block (the min terms of 16- and 32-wide groups need them). */
typedef struct {
    int8_t *q;     /* [K] */
    float *d;      /* [K / 32] */
    float *hsum;   /* [K / 16] */
} qrow;

static void quantize_row(const void *x, int64_t K, qrow r, const int BF) {
    for (int64_t b = 0; b < K / QK; b++) {
        float v[QK], amax = 0.f;
        for (int i = 0; i < QK; i++) {
            v[i] = sload(x, b * QK + i, BF);
            amax = fmaxf(amax, fabsf(v[i]));
        }
        const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        int s0 = 0, s1 = 0;
        for (int i = 0; i < QK; i++) {
            const int q = (int)nearbyintf(v[i] * id);
            r.q[b * QK + i] = (int8_t)q;
            if (i < QK / 2) s0 += q; else s1 += q;
        }
        r.d[b] = d;
        r.hsum[2 * b] = d * (float)s0;
        r.hsum[2 * b + 1] = d * (float)s1;
    }
}

/* ---- integer dot products of one 32-input block: 8 int32 lanes, lanes 0-3 the first 16 inputs */

#ifdef QUANT_AVX2
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline __m256i unpack_q4(const uint8_t *p) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p), m4 = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m4), _mm_and_si128(b, m4));
}
#endif

/* acc[r] += sum over the row's groups for weight row `n` against rows x[0..R). Result per r. */
static inline void dot_rows(int bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *mins,
                            int64_t group, int64_t K, const qrow *xr, int R, float *result) {
    const int64_t nb = K / QK, gpb = QK / group; /* groups per 32-block: 1 or 2 */
#ifdef QUANT_AVX2
    __m256 acc[ROWS_PER_PASS];
    float macc[ROWS_PER_PASS];
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); macc[r] = 0.f; }
    for (int64_t b = 0; b < nb; b++) {
        const float s0 = f16_to_f32(scales[b * gpb]), s1 = gpb == 2 ? f16_to_f32(scales[b * gpb + 1]) : s0;
        const __m256 sv = _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0));
        float m0 = 0.f, m1 = 0.f;
        if (mins != NULL) { m0 = f16_to_f32(mins[b * gpb]); m1 = gpb == 2 ? f16_to_f32(mins[b * gpb + 1]) : m0; }
        __m256i u, w8 = _mm256_setzero_si256();
        if (bits == 4) {
            u = unpack_q4(codes + b * 16);
        } else {
            w8 = _mm256_loadu_si256((const __m256i *)(codes + b * QK));
            u = _mm256_sign_epi8(w8, w8);
        }
        for (int r = 0; r < R; r++) {
            __m256i xs = _mm256_loadu_si256((const __m256i *)(xr[r].q + b * QK));
            if (bits != 4) xs = _mm256_sign_epi8(xs, w8);
            const __m256 p = _mm256_cvtepi32_ps(dot_u8s8(u, xs));
            acc[r] = _mm256_fmadd_ps(p, _mm256_mul_ps(sv, _mm256_set1_ps(xr[r].d[b])), acc[r]);
            if (mins != NULL) macc[r] += m0 * xr[r].hsum[2 * b] + m1 * xr[r].hsum[2 * b + 1];
        }
    }
    for (int r = 0; r < R; r++) {
        const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
        const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
        result[r] = _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1))) + macc[r];
    }
#else
    for (int r = 0; r < R; r++) result[r] = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        for (int half = 0; half < 2; half++) {
            const int64_t g = (b * QK + half * 16) / group;
            const float s = f16_to_f32(scales[g]), m = mins != NULL ? f16_to_f32(mins[g]) : 0.f;
            for (int r = 0; r < R; r++) {
                int sum = 0;
                for (int i = half * 16; i < half * 16 + 16; i++) {
                    const int q = bits == 4 ? ((codes[b * 16 + (i & 15)] >> (i < 16 ? 0 : 4)) & 15)
                                            : (int)((const int8_t *)codes)[b * QK + i];
                    sum += q * xr[r].q[b * QK + i];
                }
                result[r] += s * xr[r].d[b] * (float)sum + m * xr[r].hsum[2 * b + half];
            }
        }
    }
#endif
}

/* y[m, n] = sum_k x[m, k] W[n, k] for m < M, n < N; x rows x_stride elements apart, y rows N
 * apart; x and y float32 or bfloat16 (`bf16`). Returns 0, -1 where scratch memory ran out, -2
 * for a shape the kernel does not take (K not a multiple of 32, group not 16 or 32). */
static int matmul_rows(int bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *mins, int64_t group,
                       int64_t N, int64_t K, const void *x, int64_t x_stride, int64_t M, void *y, const int BF) {
    if (K % QK || (group != 16 && group != 32) || (bits == 4 && group != 32)) return -2;
    int8_t *q = malloc((size_t)(M * K));
    float *d = malloc(sizeof(float) * (size_t)(M * (K / QK) * 3));
    if (q == NULL || d == NULL) { free(q); free(d); return -1; }
#pragma omp parallel for schedule(static) if (M * K >= 65536)
    for (int64_t m = 0; m < M; m++) {
        const qrow r = {q + m * K, d + m * (K / QK) * 3, d + m * (K / QK) * 3 + K / QK};
        quantize_row(at(x, m * x_stride, BF), K, r, BF);
    }
    const int64_t code_row = bits == 4 ? K / 2 : K, scale_row = K / group;
#pragma omp parallel for schedule(static) if (N * K * M >= 32768)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *c = codes + n * code_row;
        const uint16_t *s = scales + n * scale_row, *mn = mins != NULL ? mins + n * scale_row : NULL;
        for (int64_t m0 = 0; m0 < M; m0 += ROWS_PER_PASS) {
            const int R = M - m0 < ROWS_PER_PASS ? (int)(M - m0) : ROWS_PER_PASS;
            qrow xr[ROWS_PER_PASS];
            float out[ROWS_PER_PASS];
            for (int r = 0; r < R; r++) {
                float *dr = d + (m0 + r) * (K / QK) * 3;
                xr[r] = (qrow){q + (m0 + r) * K, dr, dr + K / QK};
            }
            dot_rows(bits, c, s, mn, group, K, xr, R, out);
            for (int r = 0; r < R; r++) sstore(y, (m0 + r) * N + n, out[r], BF);
        }
    }
    free(q);
    free(d);
    return 0;
}

int quant_matmul(int64_t bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *mins, int64_t group,
                 int64_t N, int64_t K, const void *x, int64_t x_stride, int64_t M, void *y, int64_t bf16) {
    return bf16 ? matmul_rows((int)bits, codes, scales, mins, group, N, K, x, x_stride, M, y, 1)
                : matmul_rows((int)bits, codes, scales, mins, group, N, K, x, x_stride, M, y, 0);
}

static inline void dequant_row(int bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *mins,
                               int64_t group, int64_t K, void *out, const int BF) {
    for (int64_t h = 0; h < K / 16; h++) { /* half blocks of 16 inputs: one scale each */
        const int64_t g = h * 16 / group, b = h / 2, hi = h % 2;
        const float s = f16_to_f32(scales[g]), m = mins != NULL ? f16_to_f32(mins[g]) : 0.f;
        float v[16];
        if (bits == 4) {
            const uint8_t *c = codes + b * 16;
            for (int j = 0; j < 16; j++) v[j] = s * (float)((c[j] >> (hi * 4)) & 15) + m;
        } else {
            const int8_t *c = (const int8_t *)codes + h * 16;
            for (int j = 0; j < 16; j++) v[j] = s * (float)c[j] + m;
        }
        for (int j = 0; j < 16; j++) sstore(out, h * 16 + j, v[j], BF);
    }
}

static void dequant_rows(int bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *mins, int64_t group,
                         int64_t K, const int64_t *rows, int64_t first, int64_t n, void *out, const int BF) {
    const int64_t code_row = bits == 4 ? K / 2 : K, scale_row = K / group;
#pragma omp parallel for schedule(static) if (n * K >= 65536)
    for (int64_t i = 0; i < n; i++) {
        const int64_t row = rows != NULL ? rows[i] : first + i;
        dequant_row(bits, codes + row * code_row, scales + row * scale_row,
                    mins != NULL ? mins + row * scale_row : NULL, group, K, at(out, i * K, BF), BF);
    }
}

/* out (n, K) = rows of W: rows[i] where `rows` is given, else first + i. */
int quant_dequant(int64_t bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *mins, int64_t group,
                  int64_t K, const int64_t *rows, int64_t first, int64_t n, void *out, int64_t bf16) {
    if (K % QK || (group != 16 && group != 32)) return -2;
    if (bf16) dequant_rows((int)bits, codes, scales, mins, group, K, rows, first, n, out, 1);
    else dequant_rows((int)bits, codes, scales, mins, group, K, rows, first, n, out, 0);
    return 0;
}
