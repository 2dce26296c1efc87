/* Matrix products with weights kept packed (quantized) in memory, on CPU.
 *
 * Two layouts serve every packed GGUF type (layers/quant.py maps them):
 *   4-bit: codes uint8 [N, K/2], per group of 32 inputs 16 bytes, byte j holding input j (low
 *          nibble) and input j+16 (high nibble), as GGUF's Q4_0/Q4_1 blocks do;
 *          w = scale * q + min, q in 0..15.
 *   8-bit: codes int8 [N, K]; w = scale * q (+ min where mins are given); groups of 16 or 32.
 * Scales and mins are float16 [N, K / group].
 *
 * quant_matmul: y (M, N) = x (M, K) W^T, for small M (decode), where reading the weights is the
 * cost. Each row of x is quantized to int16 per 32 inputs (scale amax/32767: a relative error
 * of 2^-16 of the block's largest value, far below bf16's), so a block's dot product is two
 * int16 multiply-adds (`madd`) on the codes widened to int16, times the scales; min terms use the
 * exact float sums of x. int8 activations (llama.cpp's choice, one `maddubs` per block) were
 * about a fifth faster here but changed the default model's greedy answers, and converting the
 * codes to float cost three times the shuffles. Each weight block is loaded once for up to four
 * rows of x; at one row, 4-bit weights go four W rows at a time (`dot_rows4`: a block's halves
 * share a scale, so they sum in int32, with one `vpdpwssd` where the CPU has AVX-VNNI or
 * AVX512-VNNI); with AVX-512, 8-bit ones go through `dot_row8_512` (a block per 512-bit register,
 * one W row after another: a single stream through memory; the LM head). The instruction set is
 * the build's (-march=native, one library per CPU: see cpu_kernels.py), so the choice is made per
 * CPU; NANOVLLM_CPU_ISA builds this CPU's library without AVX-512 or without VNNI, to time and
 * test those paths here (`cpu_kernels_isa` says which a library got); tests build the baseline
 * x86-64 variant too.
 * With AVX-512, batch-1 4-bit weights take several blocks per register instead (`rows_range`):
 * four with AVX512-VNNI (`dot_quads`: x's int16 codes split into high and low bytes for
 * `vpdpbusd`, the block sums still exact), two without (`dot4_512`); four W rows a pass, or one
 * where rows are long (SINGLE_ROW_BYTES); W is prefetched PREFETCH_BYTES ahead, which alone gave
 * 1.5x at one thread.
 * With AVX-512, 2-8 rows of x (a small decode step) take these batch-1 kernels once per row, the
 * same four (or two) W rows staying in L1 across the rows: each row's products are then those it
 * would get alone, and 8 rows cost ~0.6x the general loop (`dot_rows`, which other builds keep).
 * Large M: quant_gemm_bf16 where the CPU has AVX512-BF16 and x is bfloat16 (64 weight rows
 * dequantized to bfloat16 and transposed in registers into a tile that stays in L2, then every
 * row of x against it with `vdpbf16ps`, float32 sums); elsewhere quant_dequant into a float panel
 * and the float GEMM.
 * quant_dequant: rows of W as float32 or bfloat16 (`bf16`), for that panel and the embedding:
 * with AVX-512 a 32-input block is two 16-lane vectors stored straight out (bfloat16 by one
 * `vcvtne2ps2bf16` where the CPU has AVX512-BF16), ~4x the AVX2 loop it replaced on AVX-512
 * CPUs, which went through a float buffer per block.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "cpu_simd.h"

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define QUANT_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define QUANT_AVX512 1 /* batch 1: one 32-input block per 512-bit register */
#endif
#endif

#define QK 32            /* inputs per activation block */
#define ROWS_PER_PASS 4  /* rows of x sharing one load of a weight block */
#define PREFETCH_BYTES 4096 /* batch 1 reads W ahead by this much: measured 1.5x over 512 at one thread */
#define MAX_GROUPS 512   /* groups per row the stack buffers hold (K up to 8192 at 16 per group) */
/* At one row of x, 4-bit W rows of at least this many code bytes go one at a time, not four
 * interleaved: the hardware prefetcher follows one stream better (measured on a Zen 4 with the
 * weights coming from memory: the default model's down projections, 768-byte rows, 0.84-0.87x the
 * time with AVX512-VNNI, 0.67-0.69x built for AVX2 alone; its 288-byte rows the same or slower one
 * at a time, so four rows, adjacent in memory, stay together there). With more rows of x the four
 * share each load of x, which matters more: 8 rows one at a time measured 0.87x the tokens/s. */
#define SINGLE_ROW_BYTES 512

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

/* The instruction set this build's products use: 0 plain C, 2 AVX2, 3 AVX-512, 4 AVX-512 with
 * VNNI (what NANOVLLM_CPU_ISA selects; layers/cpu_kernels.py). */
int cpu_kernels_isa(void) {
#if defined(QUANT_AVX512) && defined(__AVX512VNNI__)
    return 4;
#elif defined(QUANT_AVX512)
    return 3;
#elif defined(QUANT_AVX2)
    return 2;
#else
    return 0;
#endif
}

/* float32 copies of n float16 values (a row's scales or mins, converted once per row) */
static inline void f16_row(const uint16_t *h, int64_t n, float *out) {
    int64_t i = 0;
#ifdef QUANT_AVX2
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++) out[i] = f16_to_f32(h[i]);
}

/* One row of x: int16 codes per block of 32 with the block's scale, and float sums per group. */
typedef struct {
    const int16_t *q;  /* [K] */
    const float *d;    /* [K / 32] */
    const float *sum;  /* [K / group] */
} xrow;

static void quantize_row(const void *x, int64_t K, int64_t group, int16_t *q, float *d, float *sum, const int BF) {
    for (int64_t b = 0; b < K / QK; b++) {
        float v[QK], amax = 0.f;
        for (int i = 0; i < QK; i++) {
            v[i] = sload(x, b * QK + i, BF);
            amax = fmaxf(amax, fabsf(v[i]));
        }
        const float scale = amax / 32767.f, inv = scale > 0.f ? 1.f / scale : 0.f;
        for (int i = 0; i < QK; i++) q[b * QK + i] = (int16_t)nearbyintf(v[i] * inv);
        d[b] = scale;
    }
    for (int64_t g = 0; g < K / group; g++) {
        float s = 0.f;
        for (int64_t i = g * group; i < (g + 1) * group; i++) s += sload(x, i, BF);
        sum[g] = s;
    }
}

#ifdef QUANT_AVX2
/* Block b's 32 codes widened to int16: inputs 0..15 in lo, 16..31 in hi. */
static inline void codes16(int bits, const uint8_t *codes, int64_t b, __m256i *lo, __m256i *hi) {
    if (bits == 4) {
        const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(codes + b * 16)));
        *lo = _mm256_and_si256(v, _mm256_set1_epi16(0x0f));
        *hi = _mm256_srli_epi16(v, 4);
    } else {
        *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(codes + b * QK)));
        *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(codes + b * QK + 16)));
    }
}
#endif

/* result[r] = W row . x row r for r < R. sc/mn: the W row's scales and mins as float32. */
static inline __attribute__((always_inline)) void dot_rows_body(int bits, const uint8_t *codes, const float *sc,
                                                                 const float *mn, int64_t group, int64_t K,
                                                                 const xrow *xr, const int R, float *result) {
    const int64_t nb = K / QK, gpb = QK / group; /* groups per block: 1 or 2 */
    for (int r = 0; r < R; r++) {
        float s = 0.f;
        if (mn != NULL)
            for (int64_t g = 0; g < K / group; g++) s += mn[g] * xr[r].sum[g];
        result[r] = s;
    }
#ifdef QUANT_AVX2
    /* Two accumulators per row (even and odd blocks), so the loop is not bound by one chain of
     * dependent adds. */
    __m256 acc[2][ROWS_PER_PASS];
    for (int r = 0; r < R; r++) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i lo, hi;
        codes16(bits, codes, b, &lo, &hi);
        const __m256 s0 = _mm256_broadcast_ss(sc + b * gpb), s1 = _mm256_broadcast_ss(sc + b * gpb + gpb - 1);
        for (int r = 0; r < R; r++) {
            const int16_t *xq = xr[r].q + b * QK;
            const __m256 p0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)xq)));
            const __m256 p1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xq + 16))));
            const __m256 t = _mm256_fmadd_ps(p1, s1, _mm256_mul_ps(p0, s0));
            acc[b & 1][r] = _mm256_fmadd_ps(t, _mm256_broadcast_ss(xr[r].d + b), acc[b & 1][r]);
        }
    }
    for (int r = 0; r < R; r++) {
        const __m256 a = _mm256_add_ps(acc[0][r], acc[1][r]);
        const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
        result[r] += _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
    }
#else
    for (int64_t b = 0; b < nb; b++) {
        for (int half = 0; half < 2; half++) {
            const float s = sc[(b * QK + half * 16) / group];
            for (int r = 0; r < R; r++) {
                int32_t sum = 0;
                for (int i = half * 16; i < half * 16 + 16; i++) {
                    const int q = bits == 4 ? ((codes[b * 16 + (i & 15)] >> (i < 16 ? 0 : 4)) & 15)
                                            : (int)((const int8_t *)codes)[b * QK + i];
                    sum += q * xr[r].q[b * QK + i];
                }
                result[r] += s * xr[r].d[b] * (float)sum;
            }
        }
    }
#endif
}

#ifdef QUANT_AVX2
/* lo . x0 + hi . x1 as 8 int32 sums: one `vpdpwssd` on top of a `madd` where the CPU has VNNI. */
static inline __m256i dot16(__m256i lo, __m256i hi, __m256i x0, __m256i x1) {
#if defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(_mm256_madd_epi16(lo, x0), hi, x1);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(_mm256_madd_epi16(lo, x0), hi, x1);
#else
    return _mm256_add_epi32(_mm256_madd_epi16(lo, x0), _mm256_madd_epi16(hi, x1));
#endif
}

/* Batch 1 (one row of x), P rows of 4-bit W at a time (codes `code_row` bytes apart): P times the
 * independent work per x load. 4-bit codes have one scale per 32-input block (group 32), so a
 * block's two halves sum in int32 (no overflow: |15 * 32767| * 32 < 2^31) and one float
 * conversion and one FMA per block remain. sc: the P rows' scales, MAX_GROUPS apart. */
static inline __attribute__((always_inline)) void dot_rows4(const uint8_t *codes, int64_t code_row,
                                                            const float *sc, int64_t K, const xrow *x, float *out,
                                                            const int P) {
    const int64_t nb = K / QK;
    __m256 acc[4];
    for (int p = 0; p < P; p++) acc[p] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(x->q + b * QK));
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)(x->q + b * QK + 16));
        const float d = x->d[b];
        for (int p = 0; p < P; p++) {
            __m256i lo, hi;
            _mm_prefetch((const char *)(codes + p * code_row + b * 16 + 256), _MM_HINT_T0);
            codes16(4, codes + p * code_row, b, &lo, &hi);
            acc[p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot16(lo, hi, x0, x1)),
                                     _mm256_set1_ps(sc[p * MAX_GROUPS + b] * d), acc[p]);
        }
    }
    for (int p = 0; p < P; p++) {
        const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[p]), _mm256_extractf128_ps(acc[p], 1));
        const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
        out[p] += _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
    }
}
#endif

#ifdef QUANT_AVX512
/* Block b's scales: lanes 0..7 (inputs 0..15) and 8..15 (inputs 16..31), groups of 32 or 16. */
static inline __m512 scales512(const float *sc, int64_t b, int64_t gpb) {
    return _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(sc[b * gpb]), _mm512_set1_ps(sc[b * gpb + gpb - 1]));
}

/* Batch 1, one row of 8-bit W (scales as float32) against one row of x: a block per 512-bit
 * register, its int16 dot products in one `madd`. One W row at a time, not four interleaved (as
 * before): a single stream through memory, which the hardware prefetcher follows; the LM head
 * read from memory took about twice the time interleaved (Zen 4). A block is half a cache line, so
 * every other block prefetches. */
static inline float dot_row8_512(const uint8_t *codes, const float *sc, int64_t group, int64_t K, const xrow *x) {
    const int64_t nb = K / QK, gpb = QK / group;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        if (b % 2 == 0) _mm_prefetch((const char *)(codes + b * QK + PREFETCH_BYTES), _MM_HINT_T0);
        const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(codes + b * QK)));
        const __m512 prod = _mm512_cvtepi32_ps(_mm512_madd_epi16(w, _mm512_loadu_si512((const void *)(x->q + b * QK))));
        acc = _mm512_fmadd_ps(_mm512_mul_ps(prod, scales512(sc, b, gpb)), _mm512_set1_ps(x->d[b]), acc);
    }
    return _mm512_reduce_add_ps(acc);
}
#endif

#ifdef QUANT_AVX512
/* One row of x's int16 codes as `dot4_512` reads them: per pair of blocks (b, b+1), inputs 0..15
 * of both, then inputs 16..31 of both (64 lanes); an odd last block is paired with zeros. */
static void pair_layout(const int16_t *q, int64_t nb, int16_t *out) {
    for (int64_t b = 0; b < nb; b += 2) {
        const __m256i *p = (const __m256i *)(q + b * QK), zero = _mm256_setzero_si256();
        const int two = b + 1 < nb;
        _mm256_storeu_si256((__m256i *)(out + b * QK), _mm256_loadu_si256(p));
        _mm256_storeu_si256((__m256i *)(out + b * QK + 16), two ? _mm256_loadu_si256(p + 2) : zero);
        _mm256_storeu_si256((__m256i *)(out + b * QK + 32), _mm256_loadu_si256(p + 1));
        _mm256_storeu_si256((__m256i *)(out + b * QK + 48), two ? _mm256_loadu_si256(p + 3) : zero);
    }
}

#define SD_ROW (MAX_GROUPS + 16) /* a W row's per-block scale x activation scale, padded */

/* out = sum_g mins[g] * sums[g] (float16 mins) and sd[b] = scales[b] * d[b] for b < nb, sd[nb] = 0,
 * 16 groups per instruction: the per-row work of the batch-1 4-bit kernel (groups of 32). */
static inline float row_setup512(const uint16_t *scales, const uint16_t *mins, const float *sums, const float *d,
                                 int64_t nb, float *sd) {
    __m512 macc = _mm512_setzero_ps();
    int64_t g = 0;
    for (; g + 16 <= nb; g += 16) {
        _mm512_storeu_ps(sd + g, _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + g))),
                                               _mm512_loadu_ps(d + g)));
        if (mins != NULL)
            macc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mins + g))),
                                   _mm512_loadu_ps(sums + g), macc);
    }
    if (g < nb) {
        const __mmask16 m = (__mmask16)((1u << (nb - g)) - 1);
        _mm512_storeu_ps(sd + g, _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, scales + g)),
                                               _mm512_maskz_loadu_ps(m, d + g)));
        if (mins != NULL)
            macc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, mins + g)),
                                   _mm512_maskz_loadu_ps(m, sums + g), macc);
    }
    for (int i = 0; i < 4; i++) sd[nb + i] = 0.f; /* the blocks a last pair or quad reads past the row */
    return _mm512_reduce_add_ps(macc);
}

/* The int32 dot products of blocks (b, b+1) of one 4-bit row against x in pair layout: lanes
 * 0..7 block b, 8..15 block b + 1. `two` = 0 for an odd last block (its pair is not read). */
static inline __m512i dot_pair4(const uint8_t *c, __m512i xa, __m512i xb, const int two) {
    const __m256i raw = two ? _mm256_loadu_si256((const __m256i *)c) : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)c));
    const __m512i v = _mm512_cvtepu8_epi16(raw), lo = _mm512_and_si512(v, _mm512_set1_epi16(0x0f));
    const __m512i hi = _mm512_srli_epi16(v, 4);
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(_mm512_madd_epi16(lo, xa), hi, xb);
#else
    return _mm512_add_epi32(_mm512_madd_epi16(lo, xa), _mm512_madd_epi16(hi, xb));
#endif
}

/* Batch 1, P rows of 4-bit W (codes `code_row` bytes apart) per load of x: two blocks per 512-bit
 * register, so half the instructions of `dot_rows4` per weight. sd: the P rows' `row_setup512`
 * scales, SD_ROW apart; xp: x in `pair_layout`. */
static inline __attribute__((always_inline)) void dot4_512(const uint8_t *codes, int64_t code_row, const float *sd,
                                                           int64_t nb, const int16_t *xp, float *out, const int P) {
    const __m512i pick = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 acc[4];
    for (int p = 0; p < P; p++) acc[p] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const __m512i xa = _mm512_loadu_si512((const void *)(xp + b * QK)), xb = _mm512_loadu_si512((const void *)(xp + b * QK + 32));
        for (int p = 0; p < P; p++) {
            _mm_prefetch((const char *)(codes + p * code_row + b * 16 + PREFETCH_BYTES), _MM_HINT_T0);
            const __m512 s = _mm512_permutexvar_ps(pick, _mm512_castpd_ps(_mm512_broadcastsd_pd(
                _mm_load_sd((const double *)(sd + p * SD_ROW + b)))));
            acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_pair4(codes + p * code_row + b * 16, xa, xb, 1)), s, acc[p]);
        }
    }
    if (b < nb) {
        const __m512i xa = _mm512_loadu_si512((const void *)(xp + b * QK)), xb = _mm512_loadu_si512((const void *)(xp + b * QK + 32));
        for (int p = 0; p < P; p++) {
            const __m512 s = _mm512_permutexvar_ps(pick, _mm512_castpd_ps(_mm512_broadcastsd_pd(
                _mm_load_sd((const double *)(sd + p * SD_ROW + b)))));
            acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_pair4(codes + p * code_row + b * 16, xa, xb, 0)), s, acc[p]);
        }
    }
    for (int p = 0; p < P; p++) out[p] += _mm512_reduce_add_ps(acc[p]);
}

#if defined(__AVX512VNNI__)
/* One row of x's int16 codes as `dot_quads` reads them, split into bytes so that the 4-bit codes
 * meet them in `vpdpbusd` (64 byte products a go): x = 256 * high + low, high the signed top byte,
 * low the unsigned bottom one, both products exact in int32. Per group of four blocks, 256 bytes:
 * the low bytes of inputs 0..15 of the four blocks (16 each), of inputs 16..31, then the high
 * bytes likewise; blocks past the last are zeros. */
static void quad_layout(const int16_t *q, int64_t nb, uint8_t *out) {
    memset(out + (nb / 4) * 256, 0, 256);
    for (int64_t b = 0; b < nb; b++) {
        const __m512i v = _mm512_loadu_si512((const void *)(q + b * QK));
        const __m256i lo = _mm512_cvtepi16_epi8(v), hi = _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8));
        uint8_t *o = out + (b / 4) * 256 + (b % 4) * 16;
        _mm_storeu_si128((__m128i *)o, _mm256_castsi256_si128(lo));
        _mm_storeu_si128((__m128i *)(o + 64), _mm256_extracti128_si256(lo, 1));
        _mm_storeu_si128((__m128i *)(o + 128), _mm256_castsi256_si128(hi));
        _mm_storeu_si128((__m128i *)(o + 192), _mm256_extracti128_si256(hi, 1));
    }
}

/* Blocks b..b+3 of one 4-bit W row (64 code bytes; `mask` keeps the bytes of the blocks that
 * exist) against x in `quad_layout`: the exact int32 dot products, lanes 4i..4i+3 block b + i. */
static inline __m512i dot_quad(const uint8_t *c, __mmask64 mask, __m512i xl0, __m512i xl1, __m512i xh0,
                               __m512i xh1) {
    const __m512i v = _mm512_maskz_loadu_epi8(mask, c), nib = _mm512_set1_epi8(0x0f);
    const __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
    __m512i high = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xh0);  /* codes unsigned, x bytes signed */
    high = _mm512_dpbusd_epi32(high, hi, xh1);
    __m512i low = _mm512_dpbusd_epi32(_mm512_setzero_si512(), xl0, lo);   /* x bytes unsigned, codes as signed */
    low = _mm512_dpbusd_epi32(low, xl1, hi);
    return _mm512_add_epi32(_mm512_slli_epi32(high, 8), low);
}

/* Batch 1, P rows of 4-bit W per load of x, four blocks per 512-bit register. */
static inline __attribute__((always_inline)) void dot_quads(const uint8_t *codes, int64_t code_row, const float *sd,
                                                            int64_t nb, const uint8_t *xq, float *out, const int P) {
    const __m512i pick = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512 acc[4];
    for (int p = 0; p < P; p++) acc[p] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b += 4) {
        const uint8_t *x = xq + (b / 4) * 256;
        const __m512i xl0 = _mm512_loadu_si512((const void *)x), xl1 = _mm512_loadu_si512((const void *)(x + 64));
        const __m512i xh0 = _mm512_loadu_si512((const void *)(x + 128)), xh1 = _mm512_loadu_si512((const void *)(x + 192));
        const __mmask64 mask = nb - b >= 4 ? ~(__mmask64)0 : (((__mmask64)1 << (16 * (nb - b))) - 1);
        for (int p = 0; p < P; p++) {
            _mm_prefetch((const char *)(codes + p * code_row + b * 16 + PREFETCH_BYTES), _MM_HINT_T0);
            const __m512 s = _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(_mm_loadu_ps(sd + p * SD_ROW + b)));
            acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_quad(codes + p * code_row + b * 16, mask, xl0, xl1, xh0, xh1)),
                                     s, acc[p]);
        }
    }
    for (int p = 0; p < P; p++) out[p] += _mm512_reduce_add_ps(acc[p]);
}
#endif

#if defined(__AVX512VNNI__)
#define LAYOUT_BYTES ((MAX_GROUPS / 4 + 1) * 256) /* quad_layout */
#else
#define LAYOUT_BYTES ((MAX_GROUPS + 1) * QK * 2)  /* pair_layout */
#endif
#define LAYOUT_ROWS 8 /* rows of x up to which 4-bit W takes the batch-1 kernel, once per row of x */
#endif /* QUANT_AVX512 */

/* R as a compile-time constant in the common cases, so the accumulators stay in registers. */
static void dot_rows(int bits, const uint8_t *codes, const float *sc, const float *mn, int64_t group, int64_t K,
                     const xrow *xr, int R, float *result) {
    if (R == 1) dot_rows_body(bits, codes, sc, mn, group, K, xr, 1, result);
    else if (R == ROWS_PER_PASS) dot_rows_body(bits, codes, sc, mn, group, K, xr, ROWS_PER_PASS, result);
    else dot_rows_body(bits, codes, sc, mn, group, K, xr, R, result);
}

/* x as the products read it: M rows quantized (`xrow`) and, at batch 1 with AVX-512, row 0 in the
 * layout of the 4-bit kernel (`quad_layout` with AVX512-VNNI, `pair_layout` without). */
typedef struct {
    const xrow *rows;
    int64_t M;
    const void *layout;
} xprep;

#define ALIGN64(n) (((n) + 63) / 64 * 64)

/* Bytes of scratch quant_prepare takes for M rows of K inputs (a handle of 64 bytes included). */
int64_t quant_prepare_bytes(int64_t M, int64_t K) {
    int64_t bytes = 64 + ALIGN64((int64_t)sizeof(xrow) * M) + ALIGN64((int64_t)sizeof(float) * M * (K / 2 + K / QK + K / 16));
#ifdef QUANT_AVX512
    bytes += LAYOUT_BYTES * (M < LAYOUT_ROWS ? M : LAYOUT_ROWS);
#endif
    return bytes;
}

/* Whether quant_matmul takes W: K a multiple of 32, groups of 16 or 32 (4-bit: 32), at most
 * MAX_GROUPS groups per row. */
int quant_shape_ok(int64_t bits, int64_t group, int64_t K) {
    return !(K % QK || (group != 16 && group != 32) || (bits == 4 && group != 32) || K / group > MAX_GROUPS);
}

/* Quantize M rows of x (x_stride elements apart) into `scratch` (quant_prepare_bytes(M, K)).
 * `par`: rows over the threads of a team of its own where there are enough of them (quant_matmul);
 * 0: this thread alone (the one-call decode step prepares each thread's own copy). */
static xprep prepare(const void *x, int64_t x_stride, int64_t M, int64_t K, int64_t group, char *scratch, int par,
                     const int BF) {
    xrow *rows = (xrow *)scratch;
    float *data = (float *)(scratch + ALIGN64((int64_t)sizeof(xrow) * M));
    const int64_t row_floats = K / 2 + K / QK + K / group; /* int16 codes, scales, sums */
    for (int64_t m = 0; m < M; m++) {
        float *row = data + m * row_floats;
        rows[m] = (xrow){(const int16_t *)row, row + K / 2, row + K / 2 + K / QK};
    }
    if (par && M * K >= 65536) {
#pragma omp parallel for schedule(static)
        for (int64_t m = 0; m < M; m++)
            quantize_row(at(x, m * x_stride, BF), K, group, (int16_t *)rows[m].q, (float *)rows[m].d,
                         (float *)rows[m].sum, BF);
    } else {
        for (int64_t m = 0; m < M; m++)
            quantize_row(at(x, m * x_stride, BF), K, group, (int16_t *)rows[m].q, (float *)rows[m].d,
                         (float *)rows[m].sum, BF);
    }
    xprep px = {rows, M, NULL};
#ifdef QUANT_AVX512
    if (M <= LAYOUT_ROWS) {
        char *layout = (char *)data + ALIGN64((int64_t)sizeof(float) * M * (K / 2 + K / QK + K / 16));
        for (int64_t m = 0; m < M; m++)
#if defined(__AVX512VNNI__)
            quad_layout(rows[m].q, K / QK, (uint8_t *)(layout + m * LAYOUT_BYTES));
#else
            pair_layout(rows[m].q, K / QK, (int16_t *)(layout + m * LAYOUT_BYTES));
#endif
        px.layout = layout;
    }
#endif
    return px;
}

/* x prepared in `scratch` by this thread alone, for quant_rows_range / quant_rows_shared: the
 * handle they take (at the start of scratch). */
void *quant_prepare(const void *x, int64_t x_stride, int64_t M, int64_t K, int64_t group, void *scratch,
                    int64_t bf16) {
    xprep *px = (xprep *)scratch; /* the handle first, the data after it */
    *px = bf16 ? prepare(x, x_stride, M, K, group, (char *)scratch + 64, 0, 1)
               : prepare(x, x_stride, M, K, group, (char *)scratch + 64, 0, 0);
    return px;
}

#ifdef QUANT_AVX512
#define PAIR8 1 /* 8-bit codes take the batch-1 branch (dot_row8_512); measured ~1.2x the general loop (LM head) */
#else
#define PAIR8 0
#endif

/* W rows per unit of work: the batch-1 kernels take them two or four at a time. */
int64_t quant_rows_step(int64_t bits, int64_t N, int64_t M) {
#ifdef QUANT_AVX2
    if (M == 1 && (bits == 4 || PAIR8) && N % 2 == 0) return N % 4 == 0 ? 4 : 2;
#ifdef QUANT_AVX512
    if (M <= LAYOUT_ROWS && N % 2 == 0) return N % 4 == 0 ? 4 : 2; /* 4- and 8-bit, each row of x as at batch 1 */
#endif
#else
    (void)bits; (void)N; (void)M;
#endif
    return 1;
}

/* y[:, n0:n1] for the prepared x, this thread alone; n0 and n1 multiples of quant_rows_step. */
static void rows_range(int bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *mins, int64_t group,
                       int64_t N, int64_t K, const xprep *px, int64_t n0, int64_t n1, void *y, const int BF) {
    const int64_t ng = K / group, code_row = bits == 4 ? K / 2 : K, M = px->M;
    const xrow *rows = px->rows;
#ifdef QUANT_AVX2
    const int P = (int)quant_rows_step(bits, N, M);
#ifdef QUANT_AVX512
    if (M <= LAYOUT_ROWS && bits == 4 && N % 2 == 0) {
        /* four rows of 4-bit W at a time (two where N is not a multiple of 4), several blocks per
         * register, against each row of x in turn while those W rows sit in L1 */
        const int64_t nb = K / QK;
#if defined(__AVX512VNNI__)
#define DOT4 dot_quads
        typedef uint8_t layout_t;
#else
#define DOT4 dot4_512
        typedef int16_t layout_t;
#endif
        for (int64_t n = n0; n < n1; n += P) {
            for (int64_t m = 0; m < M; m++) {
                const layout_t *xp = (const layout_t *)((const char *)px->layout + m * LAYOUT_BYTES);
                float sd[4 * SD_ROW], out[4];
                for (int i = 0; i < P; i++)
                    out[i] = row_setup512(scales + (n + i) * nb, mins != NULL ? mins + (n + i) * nb : NULL,
                                          rows[m].sum, rows[m].d, nb, sd + i * SD_ROW);
                if (M == 1 && code_row >= SINGLE_ROW_BYTES) /* long rows: one stream through memory */
                    for (int i = 0; i < P; i++) DOT4(codes + (n + i) * code_row, code_row, sd + i * SD_ROW, nb, xp, out + i, 1);
                else if (P == 4) DOT4(codes + n * code_row, code_row, sd, nb, xp, out, 4);
                else DOT4(codes + n * code_row, code_row, sd, nb, xp, out, 2);
                for (int i = 0; i < P; i++) sstore(y, m * N + n + i, out[i], BF);
            }
        }
#undef DOT4
        return;
    }
#endif
    if (P > 1) { /* measured: 1.5x for 4-bit codes, slower for 8-bit (but for AVX-512 pairs) */
        for (int64_t n = n0; n < n1; n += P) {
            float sc[4][MAX_GROUPS], mn[4][MAX_GROUPS];
            for (int i = 0; i < P; i++) {
                f16_row(scales + (n + i) * ng, ng, sc[i]);
                if (mins != NULL) f16_row(mins + (n + i) * ng, ng, mn[i]);
            }
            /* one row of x unless 8-bit codes with AVX-512: then each of up to LAYOUT_ROWS rows in
             * turn, as at batch 1, while the P rows of W sit in L1 (read one after another) */
            for (int64_t m = 0; m < M; m++) {
                float out[4] = {0.f, 0.f, 0.f, 0.f};
                if (mins != NULL)
                    for (int i = 0; i < P; i++)
                        for (int64_t g = 0; g < ng; g++) out[i] += mn[i][g] * rows[m].sum[g];
#ifdef QUANT_AVX512
                if (bits == 8)
                    for (int i = 0; i < P; i++) out[i] += dot_row8_512(codes + (n + i) * code_row, sc[i], group, K, rows + m);
                else
#endif
                if (M == 1 && code_row >= SINGLE_ROW_BYTES) /* long rows: one stream through memory */
                    for (int i = 0; i < P; i++) dot_rows4(codes + (n + i) * code_row, code_row, sc[i], K, rows + m, out + i, 1);
                else if (P == 4) dot_rows4(codes + n * code_row, code_row, sc[0], K, rows + m, out, 4);
                else dot_rows4(codes + n * code_row, code_row, sc[0], K, rows + m, out, 2);
                for (int i = 0; i < P; i++) sstore(y, m * N + n + i, out[i], BF);
            }
        }
        return;
    }
#endif
    for (int64_t n = n0; n < n1; n++) {
        float sc[MAX_GROUPS], mn[MAX_GROUPS], out[ROWS_PER_PASS];
        f16_row(scales + n * ng, ng, sc);
        if (mins != NULL) f16_row(mins + n * ng, ng, mn);
        for (int64_t m0 = 0; m0 < M; m0 += ROWS_PER_PASS) {
            const int R = M - m0 < ROWS_PER_PASS ? (int)(M - m0) : ROWS_PER_PASS;
            dot_rows(bits, codes + n * code_row, sc, mins != NULL ? mn : NULL, group, K, rows + m0, R, out);
            for (int r = 0; r < R; r++) sstore(y, (m0 + r) * N + n, out[r], BF);
        }
    }
}

void quant_rows_range(int64_t bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *mins,
                      int64_t group, int64_t N, int64_t K, const void *prepared, int64_t n0, int64_t n1, void *y,
                      int64_t bf16) {
    if (bf16) rows_range((int)bits, codes, scales, mins, group, N, K, prepared, n0, n1, y, 1);
    else rows_range((int)bits, codes, scales, mins, group, N, K, prepared, n0, n1, y, 0);
}

/* This thread's share of y = x W^T among the threads of the enclosing team (all of it outside a
 * team): the contiguous slice a static schedule gives it, in units of quant_rows_step rows, and no
 * barrier at the end. Each output is computed as alone, so the split never changes a result. */
void quant_rows_shared(int64_t bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *mins,
                       int64_t group, int64_t N, int64_t K, const void *prepared, void *y, int64_t bf16) {
    const int64_t step = quant_rows_step(bits, N, ((const xprep *)prepared)->M), units = (N + step - 1) / step;
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num(), per = (units + threads - 1) / threads;
    const int64_t n0 = t * per * step, n1 = (t + 1) * per * step < N ? (t + 1) * per * step : N;
    if (n0 < n1) quant_rows_range(bits, codes, scales, mins, group, N, K, prepared, n0, n1, y, bf16);
}

/* y[m, n] = sum_k x[m, k] W[n, k] for m < M, n < N; x rows x_stride elements apart, y rows N
 * apart; x and y float32 or bfloat16 (`bf16`). Returns 0, -1 where scratch memory ran out, -2
 * for a shape the kernel does not take (see quant_shape_ok). */
int quant_matmul(int64_t bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *mins, int64_t group,
                 int64_t N, int64_t K, const void *x, int64_t x_stride, int64_t M, void *y, int64_t bf16) {
    if (!quant_shape_ok(bits, group, K)) return -2;
    char *scratch = malloc((size_t)quant_prepare_bytes(M, K));
    if (scratch == NULL) return -1;
    const xprep px = bf16 ? prepare(x, x_stride, M, K, group, scratch, 1, 1)
                          : prepare(x, x_stride, M, K, group, scratch, 1, 0);
#pragma omp parallel if (N * K * M >= 32768)
    quant_rows_shared(bits, codes, scales, mins, group, N, K, &px, y, bf16);
    free(scratch);
    return 0;
}

#ifdef QUANT_AVX512
/* Block b's 32 weights as two 16-lane float vectors (inputs 0..15, 16..31): scale * q + min,
 * or scale * q without mins. The product is exact (an 11-bit scale times an 8-bit code) and the
 * FMA rounds once, as the reference's multiply-then-add does. */
static inline __attribute__((always_inline)) void dequant_block512(int bits, const uint8_t *codes, int64_t b,
                                                                   __m512 s0, __m512 s1, __m512 m0, __m512 m1,
                                                                   int has_mins, __m512 *lo, __m512 *hi) {
    __m512i q0, q1;
    if (bits == 4) { /* byte j: input j (low nibble), input j + 16 (high nibble) */
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + b * 16)));
        q0 = _mm512_and_si512(v, _mm512_set1_epi32(0x0f));
        q1 = _mm512_srli_epi32(v, 4);
    } else {
        q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + b * QK)));
        q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + b * QK + 16)));
    }
    const __m512 f0 = _mm512_cvtepi32_ps(q0), f1 = _mm512_cvtepi32_ps(q1);
    *lo = has_mins ? _mm512_fmadd_ps(f0, s0, m0) : _mm512_mul_ps(f0, s0);
    *hi = has_mins ? _mm512_fmadd_ps(f1, s1, m1) : _mm512_mul_ps(f1, s1);
}
#endif

/* One row of W (K inputs) as float32 or bfloat16 (`BF`) in `out`. With AVX-512 a block is two
 * 16-lane vectors written straight out: bfloat16 through one `vcvtne2ps2bf16` per block where the
 * CPU has AVX512-BF16 (round to nearest even, as the software rounding: the weights are multiples
 * of a float16 scale, never float32 denormals, which the instruction would flush), the vector
 * rounding of cpu_simd.h elsewhere. AVX2 takes four 8-lane vectors, plain C one weight at a time. */
static inline void dequant_row(int bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *mins,
                               int64_t group, int64_t K, void *out, const int BF) {
    const int64_t ng = K / group, gpb = QK / group;
    float sc[MAX_GROUPS], mn[MAX_GROUPS];
    f16_row(scales, ng, sc);
    if (mins != NULL) f16_row(mins, ng, mn);
    else memset(mn, 0, sizeof(float) * (size_t)ng);
    for (int64_t b = 0; b < K / QK; b++) {
        const float s0 = sc[b * gpb], s1 = sc[b * gpb + gpb - 1], m0 = mn[b * gpb], m1 = mn[b * gpb + gpb - 1];
#if defined(QUANT_AVX512)
        __m512 lo, hi;
        dequant_block512(bits, codes, b, _mm512_set1_ps(s0), _mm512_set1_ps(s1), _mm512_set1_ps(m0),
                         _mm512_set1_ps(m1), mins != NULL, &lo, &hi);
#if defined(__AVX512BF16__)
        if (BF) {
            _mm512_storeu_si512(at(out, b * QK, BF), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
            continue;
        }
#endif
        vstore(out, b * QK, (vf)lo, BF);
        vstore(out, b * QK + 16, (vf)hi, BF);
#elif defined(QUANT_AVX2) && VL == 8
        __m256i lo, hi;
        codes16(bits, codes, b, &lo, &hi);
        const __m256 vs0 = _mm256_set1_ps(s0), vs1 = _mm256_set1_ps(s1), vm0 = _mm256_set1_ps(m0), vm1 = _mm256_set1_ps(m1);
        const __m256i q[4] = {_mm256_cvtepi16_epi32(_mm256_castsi256_si128(lo)),
                              _mm256_cvtepi16_epi32(_mm256_extracti128_si256(lo, 1)),
                              _mm256_cvtepi16_epi32(_mm256_castsi256_si128(hi)),
                              _mm256_cvtepi16_epi32(_mm256_extracti128_si256(hi, 1))};
        for (int j = 0; j < 4; j++)
            vstore(out, b * QK + 8 * j, (vf)_mm256_fmadd_ps(_mm256_cvtepi32_ps(q[j]), j < 2 ? vs0 : vs1, j < 2 ? vm0 : vm1), BF);
#else
        float v[QK];
        for (int j = 0; j < QK; j++) {
            const int q = bits == 4 ? ((codes[b * 16 + (j & 15)] >> (j < 16 ? 0 : 4)) & 15)
                                    : (int)((const int8_t *)codes)[b * QK + j];
            v[j] = (j < 16 ? s0 : s1) * (float)q + (j < 16 ? m0 : m1);
        }
        for (int j = 0; j < QK; j += VL) vstore(out, b * QK + j, loadv(v + j), BF);
#endif
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
    if (K % QK || (group != 16 && group != 32) || K / group > MAX_GROUPS) return -2;
    if (bf16) dequant_rows((int)bits, codes, scales, mins, group, K, rows, first, n, out, 1);
    else dequant_rows((int)bits, codes, scales, mins, group, K, rows, first, n, out, 0);
    return 0;
}

#if defined(QUANT_AVX512) && defined(__AVX512BF16__)
#define GEMM_NV 4  /* 16-column vectors per dequantized tile: 64 weight rows, 74 KB at K = 576 (L2) */
#define GEMM_MR 6  /* rows of x per register block: 6 x GEMM_NV accumulators of 32 registers */

/* r[i]: 32 bf16 of row i, as 16 dwords (input pairs); out[j]: pair j of the 16 rows, row i in
 * dword lane i: the layout `vdpbf16ps` reads with n in lanes. r is overwritten. */
static inline __attribute__((always_inline)) void transpose16(__m512i *r, __m512i *out) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* r[4a + c], 128-bit lane l: pair 4l + c of rows 4a..4a+3 */
    for (int a = 0; a < 16; a += 8)
        for (int c = 0; c < 4; c++) { /* t[a + c]: pairs c, c + 8 of rows a..a+3, then of rows a+4..a+7 */
            t[a + c] = _mm512_shuffle_i32x4(r[a + c], r[a + 4 + c], 0x88);     /* lanes 0, 2 of each */
            t[a + 4 + c] = _mm512_shuffle_i32x4(r[a + c], r[a + 4 + c], 0xdd); /* lanes 1, 3 of each */
        }
    for (int c = 0; c < 8; c++) { /* pair c: lanes 0 and 2 of t[c] (rows 0..7), t[c + 8] (8..15) */
        out[c] = _mm512_shuffle_i32x4(t[c], t[c + 8], 0x88);
        out[c + 8] = _mm512_shuffle_i32x4(t[c], t[c + 8], 0xdd);
    }
}

/* Weight rows n0 .. n0 + count (count <= 16 * GEMM_NV) as bfloat16, the values quant_dequant
 * gives (`dequant_block512`, one `vcvtne2ps2bf16`), transposed in registers a block of 16 rows at
 * a time: per input pair p the NV vectors of 16 columns at panel[p * NV ..], rows past count zero.
 * sc, mn: scratch for 16 rows' float scales and mins (16 * K / group each). */
static void pack_tile(int bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *mins, int64_t group,
                      int64_t K, int64_t n0, int64_t count, int NV, float *sc, float *mn, __m512i *panel) {
    const int64_t code_row = bits == 4 ? K / 2 : K, ng = K / group, gpb = QK / group;
    for (int v = 0; v < NV; v++) {
        const int64_t first = n0 + 16 * v, rows = count - 16 * v < 16 ? count - 16 * v : 16;
        for (int64_t i = 0; i < rows; i++) {
            f16_row(scales + (first + i) * ng, ng, sc + i * ng);
            if (mins != NULL) f16_row(mins + (first + i) * ng, ng, mn + i * ng);
        }
        for (int64_t b = 0; b < K / QK; b++) {
            __m512i r[16], out[16];
            for (int i = 0; i < 16; i++) {
                if (i >= rows) {
                    r[i] = _mm512_setzero_si512();
                    continue;
                }
                const float *s = sc + i * ng + b * gpb, *m = mn + i * ng + b * gpb;
                const __m512 m0 = mins != NULL ? _mm512_set1_ps(m[0]) : _mm512_setzero_ps();
                const __m512 m1 = mins != NULL ? _mm512_set1_ps(m[gpb - 1]) : _mm512_setzero_ps();
                __m512 lo, hi;
                dequant_block512(bits, codes + (first + i) * code_row, b, _mm512_set1_ps(s[0]), _mm512_set1_ps(s[gpb - 1]),
                                 m0, m1, mins != NULL, &lo, &hi);
                r[i] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
            }
            transpose16(r, out);
            for (int j = 0; j < 16; j++) _mm512_store_si512(panel + (b * 16 + j) * NV + v, out[j]);
        }
    }
}

/* y rows m .. m + MR, columns of the tile (NV vectors, the last `last` lanes wide) = x . tile^T:
 * one broadcast input pair of a row of x times NV vectors of the panel per `vdpbf16ps`, float32
 * sums, rounded to bfloat16 once at the end as F.linear's output is. */
static inline __attribute__((always_inline)) void gemm_block(const uint16_t *x, int64_t x_stride,
                                                             const __m512i *panel, int64_t pairs, const int NV,
                                                             const int MR, uint16_t *y, int64_t y_stride,
                                                             __mmask16 last) {
    __m512 acc[GEMM_MR][GEMM_NV];
    for (int m = 0; m < MR; m++)
        for (int v = 0; v < NV; v++) acc[m][v] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh w[GEMM_NV];
        for (int v = 0; v < NV; v++) w[v] = (__m512bh)_mm512_load_si512(panel + p * NV + v);
        for (int m = 0; m < MR; m++) {
            int32_t pair;
            memcpy(&pair, x + m * x_stride + 2 * p, 4);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            for (int v = 0; v < NV; v++) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], a, w[v]);
        }
    }
    for (int m = 0; m < MR; m++)
        for (int v = 0; v < NV; v++)
            _mm256_mask_storeu_epi16(y + m * y_stride + 16 * v, v == NV - 1 ? last : 0xffff,
                                     (__m256i)_mm512_cvtneps_pbh(acc[m][v]));
}

/* All M rows of x against one packed tile of NV vectors, GEMM_MR rows at a time. */
static inline __attribute__((always_inline)) void gemm_tile(const uint16_t *x, int64_t x_stride, int64_t M,
                                                            const __m512i *panel, int64_t pairs, const int NV,
                                                            uint16_t *y, int64_t y_stride, __mmask16 last) {
    int64_t m = 0;
    for (; m + GEMM_MR <= M; m += GEMM_MR)
        gemm_block(x + m * x_stride, x_stride, panel, pairs, NV, GEMM_MR, y + m * y_stride, y_stride, last);
    switch (M - m) {
    case 5: gemm_block(x + m * x_stride, x_stride, panel, pairs, NV, 5, y + m * y_stride, y_stride, last); break;
    case 4: gemm_block(x + m * x_stride, x_stride, panel, pairs, NV, 4, y + m * y_stride, y_stride, last); break;
    case 3: gemm_block(x + m * x_stride, x_stride, panel, pairs, NV, 3, y + m * y_stride, y_stride, last); break;
    case 2: gemm_block(x + m * x_stride, x_stride, panel, pairs, NV, 2, y + m * y_stride, y_stride, last); break;
    case 1: gemm_block(x + m * x_stride, x_stride, panel, pairs, NV, 1, y + m * y_stride, y_stride, last); break;
    default: break;
    }
}
#endif

/* Whether this build has quant_gemm_bf16 (AVX-512 with AVX512-BF16). */
int quant_gemm_bf16_ok(void) {
#if defined(QUANT_AVX512) && defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* y (M, N) = x (M, K) W^T for bfloat16 x (rows x_stride elements apart) and y (rows N apart):
 * tiles of 16 * GEMM_NV weight rows are dequantized to bfloat16 (the values quant_dequant gives),
 * packed for `vdpbf16ps` in a per-thread buffer that stays in L2, and multiplied by all M rows,
 * so no panel of the whole weight passes through memory. Each thread takes a contiguous slice of
 * the columns in units of 16. Returns 0, -1 where memory ran out, -2 for a shape the kernels do
 * not take, -3 where this build has no AVX512-BF16 (quant_gemm_bf16_ok). */
int quant_gemm_bf16(int64_t bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *mins, int64_t group,
                    int64_t N, int64_t K, const void *x, int64_t x_stride, int64_t M, void *y) {
#if defined(QUANT_AVX512) && defined(__AVX512BF16__)
    if (!quant_shape_ok(bits, group, K)) return -2;
    const int64_t units = (N + 15) / 16, tile_bytes = 16 * GEMM_NV * K * 2;
    int failed = 0;
#pragma omp parallel if (M * N * K >= 65536)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t per = (units + threads - 1) / threads, u0 = t * per, u1 = u0 + per < units ? u0 + per : units;
        char *buffer = u0 < u1 ? aligned_alloc(64, (size_t)(2 * tile_bytes)) : NULL;
        if (u0 < u1 && buffer == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t u = u0; buffer != NULL && u < u1; u += GEMM_NV) {
            const int64_t end = u + GEMM_NV < u1 ? u + GEMM_NV : u1, n0 = u * 16, n1 = end * 16 < N ? end * 16 : N;
            const int NV = (int)((n1 - n0 + 15) / 16);
            const __mmask16 last = (__mmask16)(0xffffu >> (16 * NV - (n1 - n0)));
            float *sc = (float *)buffer, *mn = sc + 16 * (K / group);
            __m512i *panel = (__m512i *)(buffer + tile_bytes);
            pack_tile((int)bits, codes, scales, mins, group, K, n0, n1 - n0, NV, sc, mn, panel);
            uint16_t *yt = (uint16_t *)y + n0;
            switch (NV) {
            case 4: gemm_tile(x, x_stride, M, panel, K / 2, 4, yt, N, last); break;
            case 3: gemm_tile(x, x_stride, M, panel, K / 2, 3, yt, N, last); break;
            case 2: gemm_tile(x, x_stride, M, panel, K / 2, 2, yt, N, last); break;
            default: gemm_tile(x, x_stride, M, panel, K / 2, 1, yt, N, last); break;
            }
        }
        free(buffer);
    }
    return failed ? -1 : 0;
#else
    (void)bits; (void)codes; (void)scales; (void)mins; (void)group; (void)N; (void)K; (void)x; (void)x_stride;
    (void)M; (void)y;
    return -3;
#endif
}
