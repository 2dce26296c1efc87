/* Every decoder layer of one decode step in one call, on CPU, for weights kept packed.
 *
 * At batch 1 a step of the default model (30 layers) is ~6 ms of matrix-vector products and,
 * on the per-op path (models/decoder.py), ~6 ms more of Python: nine ops per layer, each a
 * module call, a ctypes call and a tensor allocation. Here the same nine ops run from one C
 * loop over a table of per-layer pointers built once in Python (layers/cpu_decode.py); a step
 * passes only its own data (the embeddings, positions, slots, block tables, context lengths).
 *
 * It calls the entry points of the other kernel files, linked into the same library, so the
 * arithmetic is theirs and the result is bit for bit the per-op path's: per layer
 *   normed = rms_norm(residual += x)            (layer 0: rms_norm(residual), no add)
 *   qkv    = quant_matmul(normed) (+ bias)      -> qk_norm_rope_store (q/k in place, K/V to cache)
 *   attn   = paged_attention_rows(q of qkv)     -> x = quant_matmul(attn)          (o_proj)
 *   normed = rms_norm(residual += x)            -> silu_mul(quant_matmul(normed))  (gate|up)
 *   x      = quant_matmul(act)                  (down)
 * then out = rms_norm(residual += x) with the final norm. The whole step runs in one OpenMP team
 * (torch's thread pool), started once: the per-op path starts one per product and one for
 * attention, five a layer, each with its own join. Here a layer has five barriers, one where a
 * product or attention needs all of the step before it; the small row-wise work between them
 * (norms, SiLU, quantizing a product's input) is done by every thread for itself, each holding its
 * own copy of the residual stream, which costs less than a barrier. The q/k/v projection is shared
 * out a head at a time, and the thread that computed a head norms, rotates and stores it at once;
 * attention for fewer rows than threads is shared out by heads. Each output is computed exactly as
 * on the per-op path, whichever thread computes it, so any thread count gives the same bits.
 * Activations are float32 or bfloat16 (`bf16`), as every tensor and table of the model.
 * Returns 0, -1 where scratch memory ran out, or -2 for a shape the kernels refuse (checked first).
 */
// [ZH-START]
// 本文件在整体架构中的位置：CPU 上解码步（T <= 8 行、权重全部打包量化）的"一次调用"路径。
//   DecoderModel.forward ─词嵌入→ CpuDecode（cpu_decode.py）
//     ─ctypes 一次→ decode_layers（本文件）
//     每层：rms_norm（残差相加）→ qkv quant_matmul（+ bias）→ qk_norm_rope_store（写 KV）
//           → paged_attention_rows → o_proj → rms_norm → gate_up → silu_mul → down
//     最后 final norm，输出 (T, C) 交给 LM head。
// 只调用同一个库里其他 .c 文件的入口函数（单线程版或在已有线程组里分工的版本），不复制它们的实现，
// 所以结果与逐算子路径逐位相同；整步只起一次线程组，每层五个 barrier（逐算子路径每层起五次线程
// 组）；省掉的是每层九次 Python 模块调用、ctypes 调用和张量分配（默认模
// 型 30 层，约 6 ms / token）。
// 每层的指针表（权重、norm、KV cache）在 Python 里建一次，每步只传本步数据。
// [ZH-END]
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"

/* The entry points this step drives (cpu_ops.c, cpu_quant.c, cpu_attention.c): the forms that
 * run on one thread, or share their work out over the threads of the team already running. */
void rms_norm_serial(const void *x, int64_t x_stride, void *residual, const void *w, void *out, int64_t rows,
                     int64_t dim, float eps, int64_t bf16);
void qk_norm_rope_store_head(void *qkv, int64_t rows, int64_t row_stride, int64_t u, int64_t H, int64_t KVH,
                             int64_t D, const void *q_w, const void *k_w, float eps, const void *cos_cache,
                             const void *sin_cache, const int64_t *positions, void *k_cache, void *v_cache,
                             const int64_t *slots, int64_t bf16);
void silu_mul_serial(const void *gate_up, void *out, int64_t rows, int64_t inter, int64_t bf16);
int quant_shape_ok(int64_t bits, int64_t group, int64_t K);
int64_t quant_prepare_bytes(int64_t M, int64_t K);
void *quant_prepare(const void *x, int64_t x_stride, int64_t M, int64_t K, int64_t group, void *scratch,
                    int64_t bf16);
int64_t quant_rows_step(int64_t bits, int64_t N, int64_t M);
void quant_rows_range(int64_t bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *mins,
                      int64_t group, int64_t N, int64_t K, const void *prepared, int64_t n0, int64_t n1, void *y,
                      int64_t bf16);
void quant_rows_shared(int64_t bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *mins,
                       int64_t group, int64_t N, int64_t K, const void *prepared, void *y, int64_t bf16);
int64_t paged_attention_scratch(int64_t H, int64_t D, int64_t BS);
void paged_attention_items(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                           const int64_t *block_tables, int64_t max_blocks, const int64_t *row_table,
                           const int64_t *row_ctx, void *out, int64_t num_rows, int64_t H, int64_t KVH, int64_t D,
                           int64_t BS, float scale, int64_t bf16, float *scratch);

/* A QuantizedWeight (layers/quant.py): (n, k), codes and float16 scales (and mins) per group. */
typedef struct {
    int64_t bits, group, n, k;
    const uint8_t *codes;
    const uint16_t *scales, *mins; /* mins may be NULL */
} packed_matrix;

typedef struct {
    const void *input_norm, *post_norm; /* (C,) */
    const void *q_norm, *k_norm;        /* (D,) each, or NULL (no q/k norm) */
    const void *qkv_bias;               /* ((H + 2 KVH) D,) or NULL */
    void *k_cache, *v_cache;            /* [num_blocks, block_size, KVH, D] */
    packed_matrix qkv, o, gate_up, down;
} decode_layer;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, inter, block_size;
    double eps, qk_eps, scale;
    const void *final_norm;           /* (C,) */
    const void *cos_cache, *sin_cache; /* (max_positions, D / 2) */
    const decode_layer *layers;
} decode_model;

/* This thread's share of y = x W^T for x prepared by quant_prepare; no barrier. */
static void matvec(const packed_matrix *w, const void *prepared, void *y, int64_t bf16) {
    quant_rows_shared(w->bits, w->codes, w->scales, w->mins, w->group, w->n, w->k, prepared, y, bf16);
}

/* Columns [c0, c1) of y (rows, n) += bias, rounded as torch's in-place add rounds it (once, to
 * y's dtype). */
static void add_bias(void *y, const void *bias, int64_t rows, int64_t n, int64_t c0, int64_t c1, const int BF) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = c0; i < c1; i++) sstore(y, r * n + i, sload(y, r * n + i, BF) + sload(bias, i, BF), BF);
}

static int64_t max3(int64_t a, int64_t b, int64_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }
static int64_t align64(int64_t n) { return (n + 63) / 64 * 64; }

/* Whether every matrix is one the packed kernels take and the head size one attention takes. */
static int shapes_ok(const decode_model *m) {
    if (m->head_dim > 256) return 0;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const packed_matrix *w[4] = {&m->layers[l].qkv, &m->layers[l].o, &m->layers[l].gate_up, &m->layers[l].down};
        for (int i = 0; i < 4; i++)
            if (!quant_shape_ok(w[i]->bits, w[i]->group, w[i]->k)) return 0;
    }
    return 1;
}

/* residual (T, C): the step's embeddings in, the residual stream after the last layer out;
 * out (T, C): the final norm of it. Decode row r attends over the first context_lens[r]
 * positions of block_tables[row_table[r]] (max_blocks ids a row). */
int decode_layers(const decode_model *m, void *residual, void *out, int64_t T, const int64_t *positions,
                  const int64_t *slots, const int64_t *block_tables, int64_t max_blocks, const int64_t *row_table,
                  const int64_t *context_lens, int64_t bf16) {
    // [ZH-START]
    // 1. 先检查所有层的打包矩阵形状和 head_dim（不合要求返回 -2），再一次 malloc 本步的临时区（失败
    //    返回 -1）：线程共用的 qkv (T, (H + 2KVH) D)、attn (T, H D)、x (T, C)、gate_up (T, 2I)，
    //    以及每个线程私有的一份：残差 res、normed/act、量化后的输入、注意力临时区。
    // 2. 整步只起一次线程组；每层五个 barrier，只在数据依赖处：qkv 之后、注意力之后、o_proj 之后、
    //    gate_up 之后、down 之后。rms_norm、silu_mul 和输入量化每个线程各自重复算一份（几百个元素，
    //    比一次 barrier 便宜），残差也各存一份，所以不用在它们前后同步。
    // 3. qkv 按 head 分工：算出某个 head 的 D 行输出的线程，接着做它的 bias、q/k norm、
    //    旋转和写 KV，不必等别的线程；注意力按行（行数少于线程数时按 head）分工。
    // 4. 每个输出元素的算法、求和顺序与逐算子路径相同，怎么分给线程都不改变结果（逐位相同）；
    //    最后 0 号线程做 final norm 写进 out，并把残差写回 residual。
    // [ZH-END]
    if (!shapes_ok(m)) return -2;
    const int64_t C = m->hidden, H = m->heads, KVH = m->kv_heads, D = m->head_dim, I = m->inter;
    const int64_t qkv_w = (H + 2 * KVH) * D, es = bf16 ? 2 : 4, K_max = max3(C, H * D, I);
    const float eps = (float)m->eps, qk_eps = (float)m->qk_eps, scale = (float)m->scale;
    /* shared: qkv, attn, x, gate_up; per thread: res, normed (or act), prepared x, attention scratch */
    const int64_t shared = align64(T * qkv_w * es) + align64(T * H * D * es) + align64(T * C * es) + align64(T * 2 * I * es);
    const int64_t prep_bytes = align64(quant_prepare_bytes(T, K_max));
    const int64_t own = align64(T * C * es) + align64(T * (C > I ? C : I) * es) + prep_bytes +
                        align64((int64_t)sizeof(float) * paged_attention_scratch(H, D, m->block_size));
    const int threads = omp_get_max_threads();
    char *scratch = aligned_alloc(64, (size_t)(shared + threads * own));
    if (scratch == NULL) return -1;
    char *qkv = scratch, *attn = qkv + align64(T * qkv_w * es), *x = attn + align64(T * H * D * es);
    char *gate_up = x + align64(T * C * es);
#pragma omp parallel num_threads(threads)
    {
    const int BF = bf16 != 0;
    char *res = scratch + shared + omp_get_thread_num() * own, *normed = res + align64(T * C * es);
    char *prep = normed + align64(T * (C > I ? C : I) * es);
    float *att_scratch = (float *)(prep + prep_bytes);
    memcpy(res, residual, (size_t)(T * C * es));
    for (int64_t l = 0; l < m->num_layers; l++) {
        const decode_layer *L = &m->layers[l];
        rms_norm_serial(l == 0 ? res : x, C, l == 0 ? NULL : res, L->input_norm, normed, T, C, eps, bf16);
        const void *p = quant_prepare(normed, C, T, C, L->qkv.group, prep, bf16);
        const int64_t step = quant_rows_step(L->qkv.bits, L->qkv.n, T);
        if (D % step == 0) {
            /* a head's D outputs, then at once its bias, norm, rotation and cache store */
#pragma omp for schedule(static) nowait
            for (int64_t u = 0; u < H + 2 * KVH; u++) {
                quant_rows_range(L->qkv.bits, L->qkv.codes, L->qkv.scales, L->qkv.mins, L->qkv.group, L->qkv.n,
                                 L->qkv.k, p, u * D, (u + 1) * D, qkv, bf16);
                if (L->qkv_bias != NULL) add_bias(qkv, L->qkv_bias, T, qkv_w, u * D, (u + 1) * D, BF);
                qk_norm_rope_store_head(qkv, T, qkv_w, u, H, KVH, D, L->q_norm, L->k_norm, qk_eps, m->cos_cache,
                                        m->sin_cache, positions, L->k_cache, L->v_cache, slots, bf16);
            }
        } else {
            matvec(&L->qkv, p, qkv, bf16);
#pragma omp barrier
#pragma omp for schedule(static) nowait
            for (int64_t u = 0; u < H + 2 * KVH; u++) {
                if (L->qkv_bias != NULL) add_bias(qkv, L->qkv_bias, T, qkv_w, u * D, (u + 1) * D, BF);
                qk_norm_rope_store_head(qkv, T, qkv_w, u, H, KVH, D, L->q_norm, L->k_norm, qk_eps, m->cos_cache,
                                        m->sin_cache, positions, L->k_cache, L->v_cache, slots, bf16);
            }
        }
#pragma omp barrier
        paged_attention_items(qkv, qkv_w, L->k_cache, L->v_cache, block_tables, max_blocks, row_table, context_lens,
                              attn, T, H, KVH, D, m->block_size, scale, bf16, att_scratch);
#pragma omp barrier
        matvec(&L->o, quant_prepare(attn, H * D, T, H * D, L->o.group, prep, bf16), x, bf16);
#pragma omp barrier
        rms_norm_serial(x, C, res, L->post_norm, normed, T, C, eps, bf16);
        matvec(&L->gate_up, quant_prepare(normed, C, T, C, L->gate_up.group, prep, bf16), gate_up, bf16);
#pragma omp barrier
        silu_mul_serial(gate_up, normed, T, I, bf16);
        matvec(&L->down, quant_prepare(normed, I, T, I, L->down.group, prep, bf16), x, bf16);
#pragma omp barrier
    }
    if (omp_get_thread_num() == 0) {
        rms_norm_serial(x, C, res, m->final_norm, out, T, C, eps, bf16);
        memcpy(residual, res, (size_t)(T * C * es));
    }
    }
    free(scratch);
    return 0;
}
