/* The fp32 CPU path's decoder layers in one call: the same C kernels the Python layer calls one at
 * a time (cpu_qgemm.c, cpu_attention.c, cpu_ops.c, in the same library), in the same order on the
 * same buffers, so the numbers are the same bit for bit; only the ~9 ctypes calls and the Python
 * around them per layer are gone (a small model's decode step made ~300 of them).
 *
 * Layer i, with x the residual stream and h the previous layer's output (none before layer 0):
 *   x += h; normed = rms_norm(x, attn_norm)
 *   q, cache <- rope_store_kv(qkv @ normed (+ qkv_bias if given));  attn = paged_attention(q)
 *   h = o @ attn (then rms_norm(h, post_attn_norm) if given)
 *   x += h; normed = rms_norm(x, ffn_norm)
 *   h = down @ glu(gate_up @ normed) (then rms_norm(h, post_ffw_norm) if given)
 * The caller adds the last h and applies the final norm.
 */
#include "cpu_kernels.h"

typedef struct {
    const int32_t *block_table, *cu_seqlens_q, *seq_lens;
    const int64_t *slots;
    int64_t max_blocks, num_seqs;
} meta_desc;

typedef struct {
    const qweight *qkv, *o, *gate_up, *down;
    const float *attn_norm, *post_attn_norm, *ffn_norm, *post_ffw_norm, *qk_norm, *qkv_bias; /* NULL: none */
    kv_pools kv;
    int64_t window; /* 0: none */
    int64_t rope;   /* which of the step's cos/sin tables */
    int64_t group;  /* which of the step's metadata: its KV cache group's block tables and slots */
} layer_desc;

#define MAX_ROPES 2

typedef struct {
    int64_t M, hidden, heads, kv_heads, head_dim, ffn, block_size;
    int64_t act, neox, threads;
    int64_t attn_bf16; /* paged_attention's bf16 dot products (cpu_attention.bf16_attention) */
    float eps, scale;
    const float *cos[MAX_ROPES], *sin[MAX_ROPES];
    const meta_desc *metas; /* one per KV cache group */
    float *x, *h, *normed, *qkv, *q, *attn, *gate_up, *act_out; /* [M, ...] buffers */
} step_desc;

/* y[r] += bias for each of the M rows of width n (Qwen2's q, k and v biases): the Python layer's
 * `y + bias`, one fp32 add an element, so the same bits. */
static void add_bias(float *y, const float *bias, int64_t M, int64_t n) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t j = 0; j < n; j++) y[r * n + j] += bias[j];
}

/* Returns 0, or -1 when a GEMM's or the attention's scratch cannot be allocated. */
int forward_layers(const layer_desc *layers, int64_t n, const step_desc *s) {
    const int64_t M = s->M, D = s->hidden;
    for (int64_t i = 0; i < n; i++) {
        const layer_desc *L = layers + i;
        const meta_desc *m = s->metas + L->group;
        rms_norm_f32(s->x, i ? s->h : NULL, i ? s->x : NULL, L->attn_norm, s->normed, M, D, 1, s->eps);
        if (qgemm(L->qkv, s->normed, M, s->qkv, (int)s->threads))
            return -1;
        if (L->qkv_bias)
            add_bias(s->qkv, L->qkv_bias, M, (s->heads + 2 * s->kv_heads) * s->head_dim);
        rope_store_kv(s->qkv, M, (int)s->heads, (int)s->kv_heads, (int)s->head_dim, L->qk_norm, s->eps,
                      s->cos[L->rope], s->sin[L->rope], (int)s->neox, s->q, m->slots, &L->kv);
        if (paged_attention(s->q, s->attn, M, (int)s->heads, (int)s->kv_heads, (int)s->head_dim, &L->kv,
                            (int)s->block_size, m->block_table, m->max_blocks,
                            m->cu_seqlens_q, m->seq_lens, (int)m->num_seqs, s->scale, L->window, 0.0f, (int)s->threads,
                            (int)s->attn_bf16))
            return -1;
        if (qgemm(L->o, s->attn, M, s->h, (int)s->threads))
            return -1;
        if (L->post_attn_norm)
            rms_norm_f32(s->h, NULL, NULL, L->post_attn_norm, s->h, M, D, 1, s->eps);
        rms_norm_f32(s->x, s->h, s->x, L->ffn_norm, s->normed, M, D, 1, s->eps);
        if (qgemm(L->gate_up, s->normed, M, s->gate_up, (int)s->threads))
            return -1;
        glu_f32(s->gate_up, s->act_out, M, s->ffn, (int)s->act, (int)s->threads);
        if (qgemm(L->down, s->act_out, M, s->h, (int)s->threads))
            return -1;
        if (L->post_ffw_norm)
            rms_norm_f32(s->h, NULL, NULL, L->post_ffw_norm, s->h, M, D, 1, s->eps);
    }
    return 0;
}
