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
 * then out = rms_norm(residual += x) with the final norm. Each callee keeps its own OpenMP
 * parallel loop (torch's thread pool), so 1 or N threads behave as on the per-op path.
 * Activations are float32 or bfloat16 (`bf16`), as every tensor and table of the model.
 * Returns 0, or the first failing callee's code (-1: scratch memory, -2: a shape it refuses).
 */
// [ZH-START]
// 本文件在整体架构中的位置：CPU 上 decode 步（T <= 8 行、权重全部打包量化）的"一次调用"路径。
//   DecoderModel.forward ─词嵌入→ CpuDecode（cpu_decode.py）─ctypes 一次→ decode_layers（本文件）
//     每层：rms_norm（残差相加）→ qkv quant_matmul（+ bias）→ qk_norm_rope_store（写 KV）
//           → paged_attention_rows → o_proj → rms_norm → gate_up → silu_mul → down
//     最后 final norm，输出 (T, C) 交给 LM head。
// 只调用同一个库里其他 .c 文件的入口函数，不复制它们的实现，所以结果与逐算子路径逐位相同；
// 省掉的是每层九次 Python 模块调用、ctypes 调用和张量分配（默认模型 30 层，约 6 ms / token）。
// 每层的指针表（权重、norm、KV cache）在 Python 里建一次，每步只传本步数据。
// [ZH-END]
#include <stdint.h>
#include <stdlib.h>

#include "cpu_simd.h"

/* The entry points this loop drives (cpu_ops.c, cpu_quant.c, cpu_attention.c). */
void rms_norm(const void *x, int64_t x_stride, void *residual, const void *w, void *out, int64_t rows,
              int64_t dim, float eps, int64_t bf16);
void qk_norm_rope_store(void *qkv, int64_t rows, int64_t row_stride, int64_t H, int64_t KVH, int64_t D,
                        const void *q_w, const void *k_w, float eps, const void *cos_cache, const void *sin_cache,
                        const int64_t *positions, void *k_cache, void *v_cache, const int64_t *slots, int64_t bf16);
void silu_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int64_t bf16);
int quant_matmul(int64_t bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *mins, int64_t group,
                 int64_t N, int64_t K, const void *x, int64_t x_stride, int64_t M, void *y, int64_t bf16);
int paged_attention_rows(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                         const int64_t *block_tables, int64_t max_blocks, const int64_t *row_table,
                         const int64_t *row_ctx, void *out, int64_t num_rows, int64_t H, int64_t KVH, int64_t D,
                         int64_t BS, float scale, int64_t bf16);

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

static int matvec(const packed_matrix *w, const void *x, int64_t rows, void *y, int64_t bf16) {
    return quant_matmul(w->bits, w->codes, w->scales, w->mins, w->group, w->n, w->k, x, w->k, rows, y, bf16);
}

/* y (rows, n) += bias, rounded as torch's in-place add rounds it (once, to y's dtype). */
static void add_bias(void *y, const void *bias, int64_t rows, int64_t n, const int BF) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < n; i++) sstore(y, r * n + i, sload(y, r * n + i, BF) + sload(bias, i, BF), BF);
}

#define TRY(call) do { const int rc_ = (call); if (rc_) { free(scratch); return rc_; } } while (0)

/* residual (T, C): the step's embeddings in, the residual stream after the last layer out;
 * out (T, C): the final norm of it. Decode row r attends over the first context_lens[r]
 * positions of block_tables[row_table[r]] (max_blocks ids a row). */
int decode_layers(const decode_model *m, void *residual, void *out, int64_t T, const int64_t *positions,
                  const int64_t *slots, const int64_t *block_tables, int64_t max_blocks, const int64_t *row_table,
                  const int64_t *context_lens, int64_t bf16) {
    // [ZH-START]
    // 1. 一次 malloc 本步的临时区：normed (T, C)、qkv (T, (H + 2KVH) D)、attn (T, H D)、
    //    x (T, C，o_proj / down 的输出)、gate_up (T, 2I)、act (T, I)；失败返回 -1。
    // 2. 逐层按逐算子路径的顺序调用各入口（第 0 层的 input norm 不做残差相加，
    //    residual 就是词嵌入）；任何一步返回非 0 就释放临时区并原样返回该错误码。
    // 3. 最后 rms_norm(residual += x) 用 final norm 写进 out。
    // [ZH-END]
    const int64_t C = m->hidden, H = m->heads, KVH = m->kv_heads, D = m->head_dim, I = m->inter;
    const int64_t qkv_w = (H + 2 * KVH) * D, es = bf16 ? 2 : 4;
    const float eps = (float)m->eps, qk_eps = (float)m->qk_eps, scale = (float)m->scale;
    char *scratch = malloc((size_t)(T * (2 * C + qkv_w + H * D + 3 * I) * es));
    if (scratch == NULL) return -1;
    void *normed = scratch, *x = scratch + T * C * es, *qkv = scratch + 2 * T * C * es;
    void *attn = (char *)qkv + T * qkv_w * es, *gate_up = (char *)attn + T * H * D * es;
    void *act = (char *)gate_up + T * 2 * I * es;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const decode_layer *L = &m->layers[l];
        rms_norm(l == 0 ? residual : x, C, l == 0 ? NULL : residual, L->input_norm, normed, T, C, eps, bf16);
        TRY(matvec(&L->qkv, normed, T, qkv, bf16));
        if (L->qkv_bias != NULL) {
            if (bf16) add_bias(qkv, L->qkv_bias, T, qkv_w, 1);
            else add_bias(qkv, L->qkv_bias, T, qkv_w, 0);
        }
        qk_norm_rope_store(qkv, T, qkv_w, H, KVH, D, L->q_norm, L->k_norm, qk_eps, m->cos_cache, m->sin_cache,
                           positions, L->k_cache, L->v_cache, slots, bf16);
        TRY(paged_attention_rows(qkv, qkv_w, L->k_cache, L->v_cache, block_tables, max_blocks, row_table,
                                 context_lens, attn, T, H, KVH, D, m->block_size, scale, bf16));
        TRY(matvec(&L->o, attn, T, x, bf16));
        rms_norm(x, C, residual, L->post_norm, normed, T, C, eps, bf16);
        TRY(matvec(&L->gate_up, normed, T, gate_up, bf16));
        silu_mul(gate_up, act, T, I, bf16);
        TRY(matvec(&L->down, act, T, x, bf16));
    }
    rms_norm(x, C, residual, m->final_norm, out, T, C, eps, bf16);
    free(scratch);
    return 0;
}
