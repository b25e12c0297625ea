/* What the CPU C kernels' files call of each other, and the one weight descriptor they share. All
 * cpu_*.c files are compiled together into one library (cpu_build.py); cpu_forward.c runs the other
 * files' kernels through these declarations. */
#ifndef LOCALBATCH_CPU_KERNELS_H
#define LOCALBATCH_CPU_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* A weight's format (cpu_qgemm.py's FORMATS): a constant in each copy of the tile loops. */
enum { QG_Q8, QG_Q4, QG_Q5, QG_Q6, QG_Q4K, QG_Q4_0, QG_Q5_0 };

/* A weight as Q4Weight / Q4KWeight / Q5Weight / Q6Weight / Q8Weight (cpu_qgemm.py) lay it out: built
 * once per matrix, so a call passes one pointer for it. A SplitWeight chains its parts by `next`. */
typedef struct qweight {
    int64_t K, N;
    const void *qs;
    const uint16_t *d, *m; /* m: NULL for q8, q6, q4_0 and q5_0; per block of 8 groups for q6 and q4k */
    const uint8_t *qh;     /* q5 only */
    const int8_t *sc;      /* q6: its sub-scales; q4k: each group's 6-bit scale and min (uint8) */
    int64_t fmt;           /* QG_Q8 .. QG_Q5_0 */
    const struct qweight *next; /* the matrix's next rows in a format of their own (SplitWeight), or NULL */
} qweight;

/* cpu_qgemm.c */
int qgemm(const qweight *w, const float *x, int64_t M, float *y, int nthreads);
int qgemm_isa(void); /* 1: the tiles run with AVX-512 (VNNI), 0: AVX2 */

/* A KV pool's element type (cpu_attention.py's KV_KINDS). */
enum { KV_F32, KV_F16, KV_I8 };

/* One layer's KV cache as kv_cache.py's KVCacheLayer: k and v [slots, kv_heads, d] of `kind`; an
 * int8 pool has an fp32 scale per (slot, KV head), k_scale / v_scale [slots, kv_heads] (else NULL). */
typedef struct {
    void *k, *v;
    float *k_scale, *v_scale;
    int64_t kind; /* KV_F32 .. KV_I8 */
} kv_pools;

/* cpu_attention.c */
int paged_attention(const float *q, float *out, int64_t num_tokens, int heads, int kv_heads, int d,
                    const kv_pools *kv, int block_size, const int32_t *block_table, int64_t max_blocks,
                    const int32_t *cu_seqlens_q, const int32_t *seq_lens, int num_seqs, float scale, int64_t window,
                    float softcap, int threads, int bf16);
int attention_bf16_supported(void);
void rope_store_kv(const float *qkv, int64_t num_tokens, int heads, int kv_heads, int d, const float *norm_w,
                   float eps, const float *cos, const float *sin, int neox, float *q_out, const int64_t *slots,
                   const kv_pools *kv);

/* cpu_ops.c */
void rms_norm_f32(const float *x, const float *residual, float *total, const float *w, float *out, int64_t rows,
                  int64_t dim, int64_t w_rows, float eps);
void glu_f32(const float *x, float *out, int64_t rows, int64_t f, int act, int threads);

#endif
