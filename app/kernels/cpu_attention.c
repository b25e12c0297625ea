/* Paged attention for the fp32 CPU path (x86 with AVX2, FMA and F16C; fp32, fp16 or int8 pools): reads each sequence's keys and
 * values where they lie in the block pool, instead of gathering them into a contiguous copy per
 * layer first (at many sequences the gathers and the batched SDPA cost a large share of a step;
 * docs/tuning.md).
 *
 * Layouts as app/kernels/reference.py: q/out [tokens, heads, D]; pools [blocks, block_size,
 * kv_heads, D]; block_table [seqs, max_blocks]; sequence s owns query rows cu_seqlens_q[s] ..
 * cu_seqlens_q[s+1], the last of its seq_lens[s] positions. An int8 pool carries an fp32 scale per
 * (slot, KV head) (kv_quant.py): a score is (q . k) * k_scale, a value weighed by p * v_scale, as the
 * reference orders them.
 *
 * Every (query row, head) is computed alone, over its keys in position order, in chunks of
 * KEY_CHUNK keys counted from its first visible key (online softmax across chunks), in partitions of
 * KEY_PARTITION keys merged at the end: its result depends on its own row, position and cache
 * contents only, never on the batch around it, how the prompt was chunked, or how the work was
 * split between threads. A prompt chunk's rows go as tiles (attend_tile) that share each chunk's
 * widened keys and values and compute each row exactly as it is computed alone (attend). With `bf16`
 * (CPUs with AVX512_BF16, asked for) every row goes as tiles, of one row where it would go alone, with
 * the dot products in bf16 (cpu_attention_bf16.h): one arithmetic for a position whichever way it comes.
 */
#include "cpu_kernels.h"
#include "cpu_simd.h"
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KEY_CHUNK 32
#define MAX_HEADS 128
#define ALWAYS_INLINE inline __attribute__((always_inline))  /* the pool's kind a constant in the loops */
#define PREFETCH_CHUNKS 1  /* a chunk's keys and values are requested this many chunks ahead */

/* The key and value lines of a chunk ahead, requested a few at a time from inside the current
 * chunk's loops: requested all at once, hundreds of misses stall the loads queued behind them, and
 * the memory's time adds to the arithmetic's instead of hiding under it. */
struct prefetch {
    const char *k, *v;     /* the pools, from the first element the heads read */
    const char *ks, *vs;   /* an int8 pool's scales, from the first the heads read (else NULL) */
    int64_t esize, bytes;  /* bytes of an element; of the heads' part of a key row */
    int64_t kv_heads;      /* scales a slot has */
    const int64_t *off;    /* the chunk's row starts (elements) */
    const int64_t *slot;   /* the chunk's slots */
    int n, j;              /* keys in the chunk; the next key to request */
    int64_t e;             /* the next byte of key j to request */
    int rate;              /* lines of each pool per step */
};

/* The score loops call it every four keys, the value loops before each pass over the chunk
 * (prefetch_share): a call a key cost ~12% of the kernel's time. */
static inline void prefetch_step(struct prefetch *p) {
    if (!p)
        return;
    for (int r = 0; r < p->rate && p->j < p->n; r++) {
        if (p->ks && p->e == 0) {
            _mm_prefetch(p->ks + p->slot[p->j] * p->kv_heads * 4, _MM_HINT_T0);
            _mm_prefetch(p->vs + p->slot[p->j] * p->kv_heads * 4, _MM_HINT_T0);
        }
        _mm_prefetch(p->k + p->off[p->j] * p->esize + p->e, _MM_HINT_T0);
        _mm_prefetch(p->v + p->off[p->j] * p->esize + p->e, _MM_HINT_T0);
        if ((p->e += 64) >= p->bytes)
            p->e = 0, p->j++;
    }
}

/* Requests every line not yet requested. */
static inline void prefetch_rest(struct prefetch *p) {
    p->rate = INT32_MAX;
    prefetch_step(p);
}

/* Request n keys at `off` (in `slot`), spread over `steps` calls of prefetch_step (0: all at once). */
static inline void prefetch_chunk(struct prefetch *p, const int64_t *off, const int64_t *slot, int n, int steps) {
    int64_t lines = (int64_t)n * ((p->bytes + 63) / 64);
    p->off = off, p->slot = slot, p->n = n, p->j = 0, p->e = 0;
    if (steps == 0)
        prefetch_rest(p);
    else
        p->rate = (int)((lines + steps - 1) / steps);
}

/* A value loop's share of the chunk ahead's requests, before each of its `blocks` passes over the
 * chunk's keys: as many steps in all as the keys' fours. Requested from inside the key loop, the
 * prefetch state took the registers the loop's pointers need, and they went through the stack. */
static inline void prefetch_share(struct prefetch *p, int n, int blocks) {
    for (int r = 0; r < ((n + 3) / 4 + blocks - 1) / blocks; r++)
        prefetch_step(p);
}

/* Keys in the chunk from position c0 on, the row's last visible position `last`. */
static inline int chunk_keys(int64_t c0, int64_t last) {
    return last - c0 + 1 < KEY_CHUNK ? (int)(last - c0 + 1) : KEY_CHUNK;
}

/* The eight sums of a[0..7]'s lanes, as one vector. */
static inline __m256 hsum8_ps(const __m256 *a) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Eight pool elements from element i on, as fp32 (exact): the pool holds `kind` (KV_F32 ..). */
static inline __m256 load8(const void *pool, int64_t i, int kind) {
    if (kind == KV_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)pool + i)));
    if (kind == KV_I8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)pool + i))));
    return _mm256_loadu_ps((const float *)pool + i);
}

/* q . pool[i .. i+n), n a multiple of 8. */
static inline float dot_pool(const float *q, const void *pool, int64_t i, int n, int kind) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int e = 0;
    for (; e + 16 <= n; e += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + e), load8(pool, i + e, kind), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + e + 8), load8(pool, i + e + 8, kind), s1);
    }
    if (e < n)
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + e), load8(pool, i + e, kind), s0);
    return hsum_ps(_mm256_add_ps(s0, s1));
}

/* y[0..d) += sum over keys j < n of p[j] * pool[off[j] + kv ..], keys in order: 64 elements of y
 * stay in registers while the chunk's values stream past (adding into memory a key at a time
 * loaded and stored y once per key). Each element's fmas come in the same order either way. */
static ALWAYS_INLINE void weigh_values(float *y, const float *p, const void *pool, const int64_t *off, int64_t kv,
                                       int n, int d, int kind, struct prefetch *pf) {
    for (int e0 = 0; e0 < d; e0 += 64) {
        if (e0 + 64 <= d) {
            prefetch_share(pf, n, d / 64);
            __m256 acc[8];
            for (int u = 0; u < 8; u++)
                acc[u] = _mm256_loadu_ps(y + e0 + 8 * u);
            for (int j = 0; j < n; j++) {
                __m256 pj = _mm256_set1_ps(p[j]);
                for (int u = 0; u < 8; u++)
                    acc[u] = _mm256_fmadd_ps(pj, load8(pool, off[j] + kv + e0 + 8 * u, kind), acc[u]);
            }
            for (int u = 0; u < 8; u++)
                _mm256_storeu_ps(y + e0 + 8 * u, acc[u]);
        } else {
            for (int e = e0; e < d; e += 8) {
                __m256 acc = _mm256_loadu_ps(y + e);
                for (int j = 0; j < n; j++)
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), load8(pool, off[j] + kv + e, kind), acc);
                _mm256_storeu_ps(y + e, acc);
            }
        }
    }
}

static inline void scale_vec(float *y, float a, int n) {
    __m256 va = _mm256_set1_ps(a);
    for (int i = 0; i < n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(va, _mm256_loadu_ps(y + i)));
}

/* The four sums of a[0..3]'s lanes, each summed in hsum8_ps's order: four keys' scores, the same
 * bits as when they are four of eight. */
static inline __m128 hsum4_ps(const __m256 *a) {
    __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

/* Elements e0 .. d of k heads' outputs (head sizes not a multiple of 32: the tail the pair and
 * triple loops leave), each head as weigh_values weighs it. */
static inline void weigh_values_tail(float **ys, const float **ps, int k, int e0, const void *pool,
                                     const int64_t *off, int64_t kv, int n, int d, int kind) {
    if (e0 >= d)
        return;
    int64_t rest[KEY_CHUNK];
    for (int j = 0; j < n; j++)
        rest[j] = off[j] + e0;
    for (int h = 0; h < k; h++)
        weigh_values(ys[h] + e0, ps[h], pool, rest, kv, n, d - e0, kind, NULL);
}

/* Scores (times `scale`) of two query heads that read the same KV head against keys j .. j+3:
 * each key vector is loaded (and widened from fp16) once for both. */
static ALWAYS_INLINE void scores_pair(const float *qa, const float *qb, const void *pool, const int64_t *off,
                                      int64_t kv, int d, int kind, float scale, float *sa, float *sb) {
    __m256 a[4], b[4];
    for (int u = 0; u < 4; u++)
        a[u] = b[u] = _mm256_setzero_ps();
    for (int e = 0; e < d; e += 8) {
        __m256 qva = _mm256_loadu_ps(qa + e), qvb = _mm256_loadu_ps(qb + e);
        for (int u = 0; u < 4; u++) {
            __m256 k = load8(pool, off[u] + kv + e, kind);
            a[u] = _mm256_fmadd_ps(qva, k, a[u]);
            b[u] = _mm256_fmadd_ps(qvb, k, b[u]);
        }
    }
    _mm_storeu_ps(sa, _mm_mul_ps(hsum4_ps(a), _mm_set1_ps(scale)));
    _mm_storeu_ps(sb, _mm_mul_ps(hsum4_ps(b), _mm_set1_ps(scale)));
}

/* Scores (times `scale`) of one query vector against keys j .. j+3, each summed as scores_pair sums it. */
static ALWAYS_INLINE void scores_one(const float *qa, const void *pool, const int64_t *off, int64_t kv, int d,
                                     int kind, float scale, float *sa) {
    __m256 a[4];
    for (int u = 0; u < 4; u++)
        a[u] = _mm256_setzero_ps();
    for (int e = 0; e < d; e += 8) {
        __m256 qva = _mm256_loadu_ps(qa + e);
        for (int u = 0; u < 4; u++)
            a[u] = _mm256_fmadd_ps(qva, load8(pool, off[u] + kv + e, kind), a[u]);
    }
    _mm_storeu_ps(sa, _mm_mul_ps(hsum4_ps(a), _mm_set1_ps(scale)));
}

/* weigh_values for two query heads of one KV head: each value vector loaded once for both; every
 * element's fmas in the same order as weigh_values's. */
static ALWAYS_INLINE void weigh_values_pair(float *ya, float *yb, const float *pa, const float *pb, const void *pool,
                                            const int64_t *off, int64_t kv, int n, int d, int kind,
                                            struct prefetch *pf) {
    int e0 = 0;
    for (; e0 + 32 <= d; e0 += 32) {
        __m256 a[4], b[4];
        prefetch_share(pf, n, d / 32);
        for (int u = 0; u < 4; u++)
            a[u] = _mm256_loadu_ps(ya + e0 + 8 * u), b[u] = _mm256_loadu_ps(yb + e0 + 8 * u);
        for (int j = 0; j < n; j++) {
            __m256 wa = _mm256_set1_ps(pa[j]), wb = _mm256_set1_ps(pb[j]);
            for (int u = 0; u < 4; u++) {
                __m256 v = load8(pool, off[j] + kv + e0 + 8 * u, kind);
                a[u] = _mm256_fmadd_ps(wa, v, a[u]);
                b[u] = _mm256_fmadd_ps(wb, v, b[u]);
            }
        }
        for (int u = 0; u < 4; u++)
            _mm256_storeu_ps(ya + e0 + 8 * u, a[u]), _mm256_storeu_ps(yb + e0 + 8 * u, b[u]);
    }
    const float *ps[2] = {pa, pb};
    float *ys[2] = {ya, yb};
    weigh_values_tail(ys, ps, 2, e0, pool, off, kv, n, d, kind);
}

/* Scores (times `scale`) of three query heads that read the same KV head against keys j .. j+3:
 * each key vector is widened once for all three; each score summed as scores_pair sums it. */
static ALWAYS_INLINE void scores_triple(const float *qa, const float *qb, const float *qc, const void *pool,
                                        const int64_t *off, int64_t kv, int d, int kind, float scale, float *sa,
                                        float *sb, float *sc) {
    __m256 a[4], b[4], c[4];
    for (int u = 0; u < 4; u++)
        a[u] = b[u] = c[u] = _mm256_setzero_ps();
    for (int e = 0; e < d; e += 8) {
        for (int u = 0; u < 4; u++) {
            __m256 k = load8(pool, off[u] + kv + e, kind);
            a[u] = _mm256_fmadd_ps(_mm256_loadu_ps(qa + e), k, a[u]);
            b[u] = _mm256_fmadd_ps(_mm256_loadu_ps(qb + e), k, b[u]);
            c[u] = _mm256_fmadd_ps(_mm256_loadu_ps(qc + e), k, c[u]);
        }
    }
    __m128 vs = _mm_set1_ps(scale);
    _mm_storeu_ps(sa, _mm_mul_ps(hsum4_ps(a), vs));
    _mm_storeu_ps(sb, _mm_mul_ps(hsum4_ps(b), vs));
    _mm_storeu_ps(sc, _mm_mul_ps(hsum4_ps(c), vs));
}

/* weigh_values for three query heads of one KV head: each value vector widened once for all
 * three; every element's fmas in weigh_values's order. */
static ALWAYS_INLINE void weigh_values_triple(float *ya, float *yb, float *yc, const float *pa, const float *pb,
                                              const float *pc, const void *pool, const int64_t *off, int64_t kv,
                                              int n, int d, int kind, struct prefetch *pf) {
    int e0 = 0;
    for (; e0 + 32 <= d; e0 += 32) {
        __m256 a[4], b[4], c[4];
        prefetch_share(pf, n, d / 32);
        for (int u = 0; u < 4; u++) {
            a[u] = _mm256_loadu_ps(ya + e0 + 8 * u);
            b[u] = _mm256_loadu_ps(yb + e0 + 8 * u);
            c[u] = _mm256_loadu_ps(yc + e0 + 8 * u);
        }
        for (int j = 0; j < n; j++) {
            __m256 wa = _mm256_broadcast_ss(pa + j), wb = _mm256_broadcast_ss(pb + j), wc = _mm256_broadcast_ss(pc + j);
            const int64_t o = off[j] + kv + e0;
            for (int u = 0; u < 4; u++) {
                __m256 v = load8(pool, o + 8 * u, kind);
                a[u] = _mm256_fmadd_ps(wa, v, a[u]);
                b[u] = _mm256_fmadd_ps(wb, v, b[u]);
                c[u] = _mm256_fmadd_ps(wc, v, c[u]);
            }
        }
        for (int u = 0; u < 4; u++) {
            _mm256_storeu_ps(ya + e0 + 8 * u, a[u]);
            _mm256_storeu_ps(yb + e0 + 8 * u, b[u]);
            _mm256_storeu_ps(yc + e0 + 8 * u, c[u]);
        }
    }
    const float *ps[3] = {pa, pb, pc};
    float *ys[3] = {ya, yb, yc};
    weigh_values_tail(ys, ps, 3, e0, pool, off, kv, n, d, kind);
}

/* How many of query heads h .. h1-1, from h on, read h's KV head, at most three: the heads taken
 * together, so that each key and value vector is widened once for them. */
static inline int heads_sharing(int h, int h1, int group) {
    int k = 1;
    while (k < 3 && h + k < h1 && (h + k) / group == h / group)
        k++;
    return k;
}

/* The slots of positions c0 .. c0+n-1 and their pool element offsets (row starts): walking the
 * block table, with no division per key. */
static inline void key_offsets(const int32_t *blocks, int block_size, int64_t row_stride, int64_t c0, int n,
                               int64_t *off, int64_t *slot) {
    int64_t b = c0 / block_size, r = c0 % block_size;
    int64_t base = (int64_t)blocks[b] * block_size;
    for (int j = 0; j < n; j++) {
        slot[j] = base + r;
        off[j] = (base + r) * row_stride;
        if (++r == block_size) {
            r = 0;
            base = (int64_t)blocks[++b] * block_size;
        }
    }
}

#include "cpu_attention_avx512.h"

/* The scores s[i][0..n) (times `scale`, softcapped) of query heads h0+i .. h0+i+k-1, which read one
 * KV head, against the chunk's keys; an int8 pool's dot products times the keys' scales `ksc` first. */
static inline void chunk_scores(const float *q, int h0, int i, int k, int group, int d, const void *k_pool, int kind,
                                const int64_t *off, int n, const float *ksc, float scale, float softcap,
                                float (*s)[KEY_CHUNK], struct prefetch *pf, int zmm) {
    const float sc = kind == KV_I8 ? 1.0f : scale;  /* int8: the scale after the key's own */
    const int h = h0 + i;
    const float *qh = q + (int64_t)h * d;
    const int64_t kv = (int64_t)(h / group) * d;
    int j = 0;
    if (zmm) {  /* the whole eights on zmm registers, the same bits */
        const float *qs[3] = {qh, k > 1 ? qh + d : NULL, k > 2 ? qh + 2 * d : NULL};
        float *ss[3] = {s[i], k > 1 ? s[i + 1] : NULL, k > 2 ? s[i + 2] : NULL};
        j = n / 8 * 8;
        row_scores_avx512(qs, k, k_pool, off, kv, d, kind, sc, ss, j, pf);
    }
    for (; k > 1 && j + 8 <= n; j += 8)  /* eights, as the lone head's path: the tail's bits are dot_pool's */
        for (int j4 = j; j4 < j + 8; j4 += 4) {
            prefetch_step(pf);
            if (k == 3)
                scores_triple(qh, qh + d, qh + 2 * d, k_pool, off + j4, kv, d, kind, sc, &s[i][j4], &s[i + 1][j4],
                              &s[i + 2][j4]);
            else
                scores_pair(qh, qh + d, k_pool, off + j4, kv, d, kind, sc, &s[i][j4], &s[i + 1][j4]);
        }
    if (k == 1)
        for (; j + 8 <= n; j += 8) {  /* eight keys' dot products side by side, summed at once */
            prefetch_step(pf);
            prefetch_step(pf);
            __m256 acc[8];
            for (int u = 0; u < 8; u++)
                acc[u] = _mm256_setzero_ps();
            for (int e = 0; e < d; e += 8) {
                __m256 qv = _mm256_loadu_ps(qh + e);
                for (int u = 0; u < 8; u++)
                    acc[u] = _mm256_fmadd_ps(qv, load8(k_pool, off[j + u] + kv + e, kind), acc[u]);
            }
            _mm256_storeu_ps(&s[i][j], _mm256_mul_ps(hsum8_ps(acc), _mm256_set1_ps(sc)));
        }
    for (int t = i; t < i + k; t++) {
        for (int jj = j; jj < n; jj++)
            s[t][jj] = dot_pool(q + (int64_t)(h0 + t) * d, k_pool, off[jj] + kv, d, kind) * sc;
        if (kind == KV_I8)
            for (int jj = 0; jj < n; jj++)
                s[t][jj] = s[t][jj] * ksc[jj] * scale;
        if (softcap > 0.0f)
            for (int jj = 0; jj < n; jj++)
                s[t][jj] = softcap * tanhf(s[t][jj] / softcap);
    }
}

/* The chunk's scales of KV head `kvh` in an int8 pool's `scales` [slots, kv_heads]. */
static inline void chunk_scales(const float *scales, const int64_t *slot, int n, int kv_heads, int kvh, float *out) {
    for (int j = 0; j < n; j++)
        out[j] = scales[slot[j] * kv_heads + kvh];
}

/* Online softmax over one chunk for one head, all but the sum: s[0..n) become exp(s - m) (the row's
 * new running max m; s[n..] up to a multiple of 8 become 0), and l (the running sum) and y (the
 * head's output so far) are rescaled when the max moved. chunk_sums adds the chunk to l. */
static inline void chunk_exp(float *srow, int n, float *m, float *l, float *y, int d) {
    for (int j = n; j < (n + 7) / 8 * 8; j++)
        srow[j] = -INFINITY;
    __m256 vm = _mm256_set1_ps(*m);
    for (int j = 0; j < n; j += 8)
        vm = _mm256_max_ps(vm, _mm256_loadu_ps(srow + j));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    float mx = _mm_cvtss_f32(h);
    if (*m != mx) {  /* rescale what earlier chunks summed (nothing for the first) */
        float alpha = expf(*m - mx);
        *l *= alpha;
        scale_vec(y, alpha, d);
        *m = mx;
    }
    __m256 vmx = _mm256_set1_ps(mx);
    for (int j = 0; j < n; j += 8)
        _mm256_storeu_ps(srow + j, exp_ps(_mm256_sub_ps(_mm256_loadu_ps(srow + j), vmx)));
}

/* l[v] += rows[v][0] + .. + rows[v][n-1], each summed in that order from 0, for nv rows: eight rows'
 * additions interleaved, so that one row's chain of dependent additions (n of them, 3 cycles each)
 * does not set the pace. The same bits as one row at a time. */
static inline void chunk_sums(float *const *rows, int nv, int n, float *l) {
    static const float zeros[KEY_CHUNK];
    for (int v0 = 0; v0 < nv; v0 += 8) {
        const float *r[8];
        for (int u = 0; u < 8; u++)
            r[u] = v0 + u < nv ? rows[v0 + u] : zeros;
        float a[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        for (int j = 0; j < n; j++)
            for (int u = 0; u < 8; u++)
                a[u] += r[u][j];
        for (int u = 0; u < 8 && v0 + u < nv; u++)
            l[v0 + u] += a[u];
    }
}

/* Query heads h0..h1 of one row (q/out: the row's [heads, d]) attend to positions first..last;
 * query head h reads KV head h / group. All the row's heads walk the keys together: each key row
 * of the pool (every KV head side by side) is read from memory once, not once per KV head. Heads of
 * one KV head go up to three at a time (GQA): each key and value vector is widened once for them.
 * Always inlined into paged_attention's calls, one per pool type, so `kind` is a constant in its loops.
 * `zmm`: the scores, exps and value sums on zmm registers (row_scores_avx512 ..), the same bits. */
static inline __attribute__((always_inline)) void attend(const float *q, float *out, int h0, int h1, int group,
                                                         int d, const kv_pools *kv, int kind,
                                                         const int32_t *blocks, int block_size, int64_t row_stride,
                                                         int64_t first, int64_t last, float scale, float softcap,
                                                         float *ml, int zmm) {
    const void *k_pool = kv->k, *v_pool = kv->v;
    const int64_t esize = kind == KV_F32 ? 4 : kind == KV_F16 ? 2 : 1;
    float m[MAX_HEADS], l[MAX_HEADS], s[MAX_HEADS][KEY_CHUNK], ksc[KEY_CHUNK], vsc[KEY_CHUNK];
    int64_t offs[PREFETCH_CHUNKS + 1][KEY_CHUNK];  /* key row starts of this chunk and those requested */
    int64_t slots[PREFETCH_CHUNKS + 1][KEY_CHUNK]; /* their slots */
    const int kv_heads = (int)(row_stride / d);
    int nh = h1 - h0, groups = 0;
    for (int i = 0; i < nh; i += heads_sharing(h0 + i, h1, group))
        groups++;
    const int64_t e_lo = (int64_t)(h0 / group) * d, e_hi = (int64_t)((h1 - 1) / group + 1) * d;
    struct prefetch pf = {.k = (const char *)k_pool + e_lo * esize, .v = (const char *)v_pool + e_lo * esize,
                          .esize = esize, .bytes = (e_hi - e_lo) * esize, .kv_heads = kv_heads};
    if (kind == KV_I8)
        pf.ks = (const char *)(kv->k_scale + h0 / group), pf.vs = (const char *)(kv->v_scale + h0 / group);
    for (int i = 0; i < nh; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
        memset(out + (int64_t)(h0 + i) * d, 0, sizeof(float) * d);
    }
    /* The first chunks' rows: the first is read now, the others requested at once (the rows lie
     * scattered over the pool, beyond the hardware prefetcher's reach). */
    for (int64_t a = 0, c1 = first; a < PREFETCH_CHUNKS && c1 <= last; a++, c1 += KEY_CHUNK) {
        int n1 = chunk_keys(c1, last);
        key_offsets(blocks, block_size, row_stride, c1, n1, offs[a], slots[a]);
        if (a > 0)
            prefetch_chunk(&pf, offs[a], slots[a], n1, 0);
    }
    for (int64_t c0 = first, a = 0; c0 <= last; c0 += KEY_CHUNK, a++) {
        int n = chunk_keys(c0, last);
        const int64_t *off = offs[a % (PREFETCH_CHUNKS + 1)], *slot = slots[a % (PREFETCH_CHUNKS + 1)];
        /* The chunk PREFETCH_CHUNKS ahead is requested a few lines per step of this one's loops. */
        int64_t ca = c0 + PREFETCH_CHUNKS * KEY_CHUNK;
        pf.n = 0;
        if (ca <= last) {
            int na = chunk_keys(ca, last);
            const int64_t ia = (a + PREFETCH_CHUNKS) % (PREFETCH_CHUNKS + 1);
            key_offsets(blocks, block_size, row_stride, ca, na, offs[ia], slots[ia]);
            prefetch_chunk(&pf, offs[ia], slots[ia], na, groups * (n / 4 + (n + 3) / 4));
        }
        for (int i = 0, k; i < nh; i += k) {
            k = heads_sharing(h0 + i, h1, group);
            if (kind == KV_I8)
                chunk_scales(kv->k_scale, slot, n, kv_heads, (h0 + i) / group, ksc);
            chunk_scores(q, h0, i, k, group, d, k_pool, kind, off, n, ksc, scale, softcap, s, &pf, zmm);
        }
        float *rows[MAX_HEADS];
        for (int i = 0; i < nh; i++) {
            if (zmm)
                chunk_exp_avx512(s[i], n, &m[i], &l[i], out + (int64_t)(h0 + i) * d, d);
            else
                chunk_exp(s[i], n, &m[i], &l[i], out + (int64_t)(h0 + i) * d, d);
            rows[i] = s[i];
        }
        chunk_sums(rows, nh, n, l);
        for (int i = 0, k; i < nh; i += k) {
            int h = h0 + i;
            k = heads_sharing(h, h1, group);
            float *y = out + (int64_t)h * d;
            const int64_t e = (int64_t)(h / group) * d;
            if (kind == KV_I8) {  /* the weights times the values' scales (l summed the weights alone) */
                chunk_scales(kv->v_scale, slot, n, kv_heads, h / group, vsc);
                for (int t = i; t < i + k; t++)
                    for (int j = 0; j < n; j++)
                        s[t][j] *= vsc[j];
            }
            if (zmm) {
                float *ys[3] = {y, k > 1 ? y + d : NULL, k > 2 ? y + 2 * d : NULL};
                const float *ps[3] = {s[i], k > 1 ? s[i + 1] : NULL, k > 2 ? s[i + 2] : NULL};
                row_values_avx512(ys, ps, k, v_pool, off, e, n, d, kind, &pf);
            } else if (k == 3)
                weigh_values_triple(y, y + d, y + 2 * d, s[i], s[i + 1], s[i + 2], v_pool, off, e, n, d, kind, &pf);
            else if (k == 2)
                weigh_values_pair(y, y + d, s[i], s[i + 1], v_pool, off, e, n, d, kind, &pf);
            else
                weigh_values(y, s[i], v_pool, off, e, n, d, kind, &pf);
        }
        prefetch_rest(&pf);  /* whatever the loops left, before its turn */
    }
    for (int i = 0; i < nh; i++) {
        if (ml) {  /* a partition's partials: unnormalized sums, their max and total weight */
            ml[2 * (h0 + i)] = m[i];
            ml[2 * (h0 + i) + 1] = l[i];
        } else {
            scale_vec(out + (int64_t)(h0 + i) * d, 1.0f / l[i], d);
        }
    }
}

/* A row's keys are read in partitions of KEY_PARTITION positions (from its first visible key),
 * each on its own and merged after: one decode over a long context then spreads over the threads
 * reading whole pool rows (every KV head side by side, contiguous), not each thread half of each row.
 * The partitions are the same for a row whatever the batch or the threads, so its numbers are too;
 * a row of at most KEY_PARTITION keys is computed in one piece, as before partitions. */
#define KEY_PARTITION 512

struct row_plan {
    int seq;           /* the sequence that owns the row */
    int parts;         /* its partitions */
    int64_t first, last;  /* its visible positions */
    int64_t slot;      /* its first partial slot (rows of more than one partition), else -1 */
};

/* Each row's sequence, positions and partitions; returns the partial slots needed, and the
 * partitions of all rows in *parts. */
static int64_t plan_rows(struct row_plan *rows, int64_t num_tokens, const int32_t *cu_seqlens_q,
                         const int32_t *seq_lens, int num_seqs, int64_t window, int64_t *parts) {
    int64_t slots = 0;
    *parts = 0;
    for (int sq = 0; sq < num_seqs; sq++)
        for (int64_t t = cu_seqlens_q[sq]; t < cu_seqlens_q[sq + 1] && t < num_tokens; t++) {
            struct row_plan *r = &rows[t];
            r->seq = sq;
            r->last = (int64_t)seq_lens[sq] - (cu_seqlens_q[sq + 1] - cu_seqlens_q[sq]) + (t - cu_seqlens_q[sq]);
            r->first = window > 0 && r->last - window + 1 > 0 ? r->last - window + 1 : 0;
            r->parts = (int)((r->last - r->first) / KEY_PARTITION) + 1;
            r->slot = r->parts > 1 ? slots : -1;
            slots += r->parts > 1 ? r->parts : 0;
            *parts += r->parts;
        }
    return slots;
}

/* Row t's heads from its partitions' partials (in partition order): each partition's sums weighted
 * by exp(its max - the row's max), over the total weight. */
static void merge_partitions(const struct row_plan *r, float *out, const float *acc, const float *ml, int heads,
                             int h, int d) {
    float mx = -INFINITY, total = 0.0f;
    for (int p = 0; p < r->parts; p++)
        mx = fmaxf(mx, ml[((r->slot + p) * heads + h) * 2]);
    for (int e = 0; e < d; e += 8)
        _mm256_storeu_ps(out + e, _mm256_setzero_ps());
    for (int p = 0; p < r->parts; p++) {
        const float *m_l = ml + ((r->slot + p) * heads + h) * 2;
        float w = expf(m_l[0] - mx);
        total += w * m_l[1];
        __m256 vw = _mm256_set1_ps(w);
        const float *a = acc + ((r->slot + p) * heads + h) * (int64_t)d;
        for (int e = 0; e < d; e += 8)
            _mm256_storeu_ps(out + e, _mm256_fmadd_ps(vw, _mm256_loadu_ps(a + e), _mm256_loadu_ps(out + e)));
    }
    scale_vec(out, 1.0f / total, d);
}

/* A prompt chunk's rows are taken in tiles: TILE_ROWS rows x the query heads of one KV head walk each
 * chunk of keys together, its keys and values widened to fp32 once for all of them (alone, each row
 * widens each of them again, and the conversions take the FMA ports), from L1. Each vector's
 * arithmetic is attend's for that row, bit for bit. */
#define TILE_ROWS 16
#define MAX_TILE_VECS 128  /* a tile's query vectors (rows x query heads of the KV head) */

/* Scores (times `sc`) of query vectors qs[0..nv) against keys 0..n-1 of a widened chunk (rows at
 * soff), each summed as chunk_scores sums it: keys of whole eights by scores_triple's tree, the rest
 * by dot_pool's. */
static ALWAYS_INLINE void tile_scores(const float *const *qs, float *const *ss, int nv, const float *kf,
                                      const int64_t *soff, int n, int d, float sc) {
    const int n8 = n / 8 * 8;
    int v = 0;
    for (; v + 3 <= nv; v += 3)
        for (int j = 0; j < n8; j += 4)
            scores_triple(qs[v], qs[v + 1], qs[v + 2], kf, soff + j, 0, d, KV_F32, sc, ss[v] + j, ss[v + 1] + j,
                          ss[v + 2] + j);
    for (int j = 0; v + 2 == nv && j < n8; j += 4)
        scores_pair(qs[v], qs[v + 1], kf, soff + j, 0, d, KV_F32, sc, ss[v] + j, ss[v + 1] + j);
    for (int j = 0; v + 1 == nv && j < n8; j += 4)
        scores_one(qs[v], kf, soff + j, 0, d, KV_F32, sc, ss[v] + j);
    for (v = 0; v < nv; v++)
        for (int j = n8; j < n; j++)
            ss[v][j] = dot_pool(qs[v], kf, soff[j], d, KV_F32) * sc;
}

/* ys[v] += the weights ps[v][0..n) times the widened chunk's values, keys in order (weigh_values'). */
static ALWAYS_INLINE void tile_values(float *const *ys, float *const *ps, int nv, const float *vf,
                                      const int64_t *soff, int n, int d) {
    int v = 0;
    for (; v + 3 <= nv; v += 3)
        weigh_values_triple(ys[v], ys[v + 1], ys[v + 2], ps[v], ps[v + 1], ps[v + 2], vf, soff, 0, n, d, KV_F32,
                            NULL);
    if (v + 2 == nv)
        weigh_values_pair(ys[v], ys[v + 1], ps[v], ps[v + 1], vf, soff, 0, n, d, KV_F32, NULL);
    else if (v + 1 == nv)
        weigh_values(ys[v], ps[v], vf, soff, 0, n, d, KV_F32, NULL);
}

/* Keys 0..n-1 of the chunk (row starts off) of KV head g, widened into fp32 rows of d at xf. */
static inline void widen_chunk(float *xf, const void *pool, const int64_t *off, int64_t kv, int n, int d, int kind) {
    for (int j = 0; j < n; j++)
        for (int e = 0; e < d; e += 8)
            _mm256_storeu_ps(xf + (int64_t)j * d + e, load8(pool, off[j] + kv + e, kind));
}

/* Requests the key and value lines of KV head g's part of n key rows (and an int8 pool's scales). */
static inline void prefetch_rows(const kv_pools *kv, const int64_t *off, const int64_t *slot, int n, int64_t kvo,
                                 int64_t bytes, int64_t esize, int kv_heads, int g) {
    for (int j = 0; j < n; j++) {
        const char *k = (const char *)kv->k + (off[j] + kvo) * esize, *v = (const char *)kv->v + (off[j] + kvo) * esize;
        for (int64_t e = 0; e < bytes; e += 64)
            _mm_prefetch(k + e, _MM_HINT_T0), _mm_prefetch(v + e, _MM_HINT_T0);
        if (kv->k_scale)
            _mm_prefetch((const char *)(kv->k_scale + slot[j] * kv_heads + g), _MM_HINT_T0),
                _mm_prefetch((const char *)(kv->v_scale + slot[j] * kv_heads + g), _MM_HINT_T0);
    }
}

/* Keys of the chunk (c0, n keys) that tile row r sees: all of them from row r_f on, else (the
 * diagonal) those up to its last position. */
static inline int keys_seen(const int64_t *lasts, int r, int r_f, int64_t c0, int n) {
    return r < r_f ? (int)(lasts[r] - c0 + 1) : n;
}

/* Of a tile's rows (lasts), the first that sees chunk (c0, n keys), *r_c, and the first that sees all
 * of it, returned: rows r_c.. see the chunk, those before the second (the diagonal) their first keys. */
static inline int tile_rows_seeing(const int64_t *lasts, int nr, int64_t c0, int n, int *r_c) {
    int r_f;
    for (*r_c = 0; lasts[*r_c] < c0; ++*r_c)
        ;
    for (r_f = *r_c; r_f < nr && lasts[r_f] < c0 + n - 1; r_f++)
        ;
    return r_f;
}

/* The online softmax of a tile's vectors r_c * per .. over one chunk (their scores in ss, `per` vectors a
 * row): an int8 pool's key scales and the softcap applied, exp, the sums; the weights come out times an
 * int8 pool's value scales, 0 past each row's last key. */
static ALWAYS_INLINE void tile_softmax(float *const *ys, float *const *ss, float *m, float *l, const int64_t *lasts,
                                       int nr, int per, int r_c, int r_f, int64_t c0, int n, const float *ksc,
                                       const float *vsc, int kind, int d, float scale, float softcap, int wide) {
    for (int v = r_c * per; v < nr * per; v++) {
        const int nv = keys_seen(lasts, v / per, r_f, c0, n);
        float *sv = ss[v];
        if (kind == KV_I8)
            for (int j = 0; j < nv; j++)
                sv[j] = sv[j] * ksc[j] * scale;
        if (softcap > 0.0f)
            for (int j = 0; j < nv; j++)
                sv[j] = softcap * tanhf(sv[j] / softcap);
        if (wide)
            chunk_exp_avx512(sv, nv, &m[v], &l[v], ys[v], d);
        else
            chunk_exp(sv, nv, &m[v], &l[v], ys[v], d);
        for (int j = nv; j < n; j++)  /* a diagonal row's keys it does not see: adding 0 keeps its sum's bits */
            sv[j] = 0.0f;
    }
    chunk_sums(ss + r_c * per, (nr - r_c) * per, n, l + r_c * per);
    for (int v = r_c * per; kind == KV_I8 && v < nr * per; v++) {
        const int nv = keys_seen(lasts, v / per, r_f, c0, n);
        for (int j = 0; j < nv; j++)
            ss[v][j] *= vsc[j];
    }
}

/* One tile's query vectors (`per` a row) against one chunk (c0, n keys): scores, online softmax, values.
 * Rows r_c.. see the chunk; of them rows r_f.. see all of it, the others (the diagonal) their first keys.
 * kp: NULL, or KEY_CHUNK x d floats for the keys' pairs: the zmm loops (the same bits). */
static inline __attribute__((always_inline)) void tile_chunk(const float *const *qs, float *const *ys, float *const *ss,
                                                             float *m, float *l, const int64_t *lasts, int nr,
                                                             int per, int64_t c0, int n, const float *ksc,
                                                             const float *vsc, const kv_pools *kv, const int64_t *off,
                                                             int64_t kvo, int kind, int d, float scale, float softcap,
                                                             float *xf, float *kp, const int64_t *soff) {
    int r_c;
    const int r_f = tile_rows_seeing(lasts, nr, c0, n, &r_c);
    const float sc = kind == KV_I8 ? 1.0f : scale;  /* as chunk_scores */
    widen_chunk(xf, kv->k, off, kvo, n, d, kind);
    if (kp)
        widen_pairs(kp, xf, n / 8 * 8, d);
    for (int r = r_c; r <= r_f && r < nr; r++) {  /* the diagonal's rows one by one, then the rest together */
        const int k = r < r_f ? keys_seen(lasts, r, r_f, c0, n) : n, nv = (r < r_f ? 1 : nr - r_f) * per;
        if (kp)
            tile_scores_avx512(qs + r * per, ss + r * per, nv, xf, kp, soff, k, d, sc);
        else
            tile_scores(qs + r * per, ss + r * per, nv, xf, soff, k, d, sc);
    }
    tile_softmax(ys, ss, m, l, lasts, nr, per, r_c, r_f, c0, n, ksc, vsc, kind, d, scale, softcap, kp != NULL);
    widen_chunk(xf, kv->v, off, kvo, n, d, kind);
    for (int r = r_c; r <= r_f && r < nr; r++) {
        const int k = r < r_f ? keys_seen(lasts, r, r_f, c0, n) : n, nv = (r < r_f ? 1 : nr - r_f) * per;
        if (kp)
            tile_values_avx512(ys + r * per, ss + r * per, nv, xf, soff, k, d);
        else
            tile_values(ys + r * per, ss + r * per, nv, xf, soff, k, d);
    }
}

#include "cpu_attention_bf16.h"

/* Rows t0..t1-1 of one sequence (first position the same for all) x query heads i0..i1-1 of KV head g's
 * group, against partition p of their keys: what attend computes for each of those rows and heads alone
 * (b: NULL), or their bf16 arithmetic (b: the thread's bf16 scratch). Rows whose keys end before the
 * partition are left alone. xf: KEY_CHUNK x d floats of scratch; kp: NULL, or as many for the zmm loops'
 * key pairs (tile_chunk). */
static inline __attribute__((always_inline)) void attend_tile(const float *q, float *out, float *acc, float *ml,
                                                              const struct row_plan *rows, int64_t t0, int64_t t1,
                                                              int p, int g, int i0, int i1, int heads, int group,
                                                              int d, const kv_pools *kv, int kind,
                                                              const int32_t *blocks, int block_size,
                                                              int64_t row_stride, float scale, float softcap,
                                                              float *xf, float *kp,
                                                              const struct bf16_scratch *b) {
    const int nr = (int)(t1 - t0), kv_heads = (int)(row_stride / d), per = i1 - i0;
    const int64_t first = rows[t0].first + (int64_t)p * KEY_PARTITION, kvo = (int64_t)g * d;
    const int64_t esize = kind == KV_F32 ? 4 : kind == KV_F16 ? 2 : 1;
    int64_t last = first + KEY_PARTITION - 1 < rows[t1 - 1].last ? first + KEY_PARTITION - 1 : rows[t1 - 1].last;
    const float *qs[MAX_TILE_VECS];
    float *ys[MAX_TILE_VECS], *ss[MAX_TILE_VECS], s[MAX_TILE_VECS][KEY_CHUNK], m[MAX_TILE_VECS], l[MAX_TILE_VECS];
    float ksc[KEY_CHUNK], vsc[KEY_CHUNK];
    int64_t lasts[TILE_ROWS], soff[KEY_CHUNK], offs[2][KEY_CHUNK], slots[2][KEY_CHUNK];
    for (int j = 0; j < KEY_CHUNK; j++)
        soff[j] = (int64_t)j * d;
    for (int r = 0; r < nr; r++) {
        const struct row_plan *rp = &rows[t0 + r];
        lasts[r] = rp->last;
        for (int i = 0; i < per; i++) {
            const int v = r * per + i, h = g * group + i0 + i;
            qs[v] = q + ((t0 + r) * heads + h) * (int64_t)d;
            ys[v] = rp->parts > 1 ? acc + ((rp->slot + p) * heads + h) * (int64_t)d
                                  : out + ((t0 + r) * heads + h) * (int64_t)d;
            ss[v] = s[v];
            m[v] = -INFINITY, l[v] = 0.0f;
            if (rp->last >= first)
                memset(ys[v], 0, sizeof(float) * d);
        }
    }
    if (b)
        bf16_queries(qs, nr * per, d, b);
    key_offsets(blocks, block_size, row_stride, first, chunk_keys(first, last), offs[0], slots[0]);
    for (int64_t c0 = first, a = 0; c0 <= last; c0 += KEY_CHUNK, a++) {
        const int n = chunk_keys(c0, last);
        const int64_t *off = offs[a & 1], *slot = slots[a & 1];
        if (c0 + KEY_CHUNK <= last) {  /* the next chunk's rows, requested while this one computes */
            int nn = chunk_keys(c0 + KEY_CHUNK, last);
            key_offsets(blocks, block_size, row_stride, c0 + KEY_CHUNK, nn, offs[(a + 1) & 1], slots[(a + 1) & 1]);
            prefetch_rows(kv, offs[(a + 1) & 1], slots[(a + 1) & 1], nn, kvo, d * esize, esize, kv_heads, g);
        }
        if (kind == KV_I8) {
            chunk_scales(kv->k_scale, slot, n, kv_heads, g, ksc);
            chunk_scales(kv->v_scale, slot, n, kv_heads, g, vsc);
        }
        if (b)
            tile_chunk_bf16(b->q, ys, ss, m, l, lasts, nr, per, c0, n, ksc, vsc, kv, off, kvo, kind, d, scale, softcap, b);
        else
            tile_chunk(qs, ys, ss, m, l, lasts, nr, per, c0, n, ksc, vsc, kv, off, kvo, kind, d, scale, softcap, xf,
                       kp, soff);
    }
    for (int v = 0; v < nr * per; v++) {
        const struct row_plan *rp = &rows[t0 + v / per];
        if (rp->last < first)
            continue;
        if (rp->parts > 1) {
            float *m_l = ml + ((rp->slot + p) * heads + g * group + i0 + v % per) * 2;
            m_l[0] = m[v], m_l[1] = l[v];
        } else {
            scale_vec(ys[v], 1.0f / l[v], d);
        }
    }
}

/* Parts to divide each row's query heads into: with fewer rows than threads and too few partitions
 * to spread over them, enough that a batch of one decode still spreads over the threads; else 1
 * (whole pool rows per work item). The split never changes a number. */
static int head_splits(int64_t num_tokens, int64_t parts, int heads, int threads) {
    if (num_tokens >= threads || parts >= 2 * (int64_t)threads)
        return 1;
    int64_t per_row = (threads + num_tokens - 1) / num_tokens;
    return per_row < heads ? (int)per_row : heads;
}

/* A work item: a row's partition and query heads h0..h1 (t1 == t0 + 1, g < 0), or a tile's rows
 * t0..t1-1, their partition p and query heads h0..h1 of KV head g's group (g >= 0). */
struct work {
    int64_t t0, t1;
    int p, g, h0, h1;
};

/* Whether sequence rows t0..t1-1 go as tiles: a tile's worth of rows or more (fewer, the one-row
 * items read whole pool rows and prefetch them better: a few rows over a long context wait on the
 * memory, not the arithmetic), all from position 0 (the last row's first key is the latest; a sliding
 * window that cuts rows starts each at its own position). */
static int tiled(const struct row_plan *rows, int64_t t0, int64_t t1) {
    return t1 - t0 >= TILE_ROWS && rows[t1 - 1].first == 0;
}

/* Tiles of up to `step` rows t0..t1-1, each x its partitions x KV heads x the group's heads in parts of
 * `per`, from item n on (written when `items` is not NULL); returns the next item's index. */
static int64_t plan_tiles(const struct row_plan *rows, int64_t t0, int64_t t1, int64_t step, int kv_heads, int group,
                          int per, int64_t n, struct work *items) {
    for (int64_t a = t0; a < t1; a += step) {
        int64_t b = a + step < t1 ? a + step : t1;
        for (int p = 0; p < rows[b - 1].parts; p++)
            for (int g = 0; g < kv_heads; g++)
                for (int i0 = 0; i0 < group; i0 += per, n++)
                    if (items)
                        items[n] = (struct work){a, b, p, g, i0, i0 + per < group ? i0 + per : group};
    }
    return n;
}

/* The work items (written when `items` is not NULL); returns their count. bf16: every row goes in a
 * tile (the bf16 arithmetic is the tiles'), of one row where a window starts rows at their own
 * positions, each KV head's query heads split as the rows' heads would be (head_splits). */
static int64_t plan_work(const struct row_plan *rows, int64_t num_tokens, const int32_t *cu_seqlens_q, int num_seqs,
                         int heads, int kv_heads, int splits, int bf16, int threads, struct work *items) {
    const int group = heads / kv_heads, per = (heads + splits - 1) / splits;
    const int tile_rows = MAX_TILE_VECS / group < TILE_ROWS ? MAX_TILE_VECS / group : TILE_ROWS;
    const int group_splits = (splits + kv_heads - 1) / kv_heads < group ? (splits + kv_heads - 1) / kv_heads : group;
    int64_t n = 0;
    for (int sq = 0; sq < num_seqs; sq++) {
        int64_t t0 = cu_seqlens_q[sq], t1 = cu_seqlens_q[sq + 1] < num_tokens ? cu_seqlens_q[sq + 1] : num_tokens;
        if (t0 >= t1)
            continue;
        if (bf16) {
            n = plan_tiles(rows, t0, t1, rows[t1 - 1].first == 0 ? tile_rows : 1, kv_heads, group,
                           (group + group_splits - 1) / group_splits, n, items);
            continue;
        }
        if (tile_rows >= 2 && tiled(rows, t0, t1)) {
            n = plan_tiles(rows, t0, t1, tile_rows, kv_heads, group, group, n, items);
            continue;
        }
        for (int64_t t = t0; t < t1; t++)
            for (int p = 0; p < rows[t].parts; p++) {
                /* partitions that do not divide among the threads (a lone decode row): the last one by
                 * KV head, so that no thread waits a whole partition for the last */
                const int by_kv = per == heads && num_tokens < threads && rows[t].parts % threads && p == rows[t].parts - 1;
                const int step = by_kv ? group : per;
                for (int h0 = 0; h0 < heads; h0 += step, n++)
                    if (items)
                        items[n] = (struct work){t, t + 1, p, -1, h0, h0 + step < heads ? h0 + step : heads};
            }
    }
    return n;
}

/* One row's partition and heads, as attend computes them. */
static inline __attribute__((always_inline)) void attend_row(const float *q, float *out, float *acc, float *ml,
                                                             const struct row_plan *r, int64_t t, int p, int h0,
                                                             int h1, int heads, int group, int d, const kv_pools *kv,
                                                             int kind, const int32_t *blocks, int block_size,
                                                             int64_t row_stride, float scale, float softcap,
                                                             int zmm) {
    int64_t first = r->first + (int64_t)p * KEY_PARTITION;
    int64_t last = r->parts > 1 && first + KEY_PARTITION - 1 < r->last ? first + KEY_PARTITION - 1 : r->last;
    float *y = r->parts > 1 ? acc + (r->slot + p) * heads * d : out + t * heads * d;
    float *m_l = r->parts > 1 ? ml + (r->slot + p) * heads * 2 : NULL;
    attend(q + t * heads * d, y, h0, h1, group, d, kv, kind, blocks, block_size, row_stride, first, last, scale,
           softcap, m_l, zmm);
}

/* One work item: a tile's or a row's, over a pool of `kind` (a constant in each call's loops). */
static ALWAYS_INLINE void attend_item(const float *q, float *out, float *acc, float *ml, const struct row_plan *rows,
                                      const struct work *w, int heads, int group, int d, const kv_pools *kv, int kind,
                                      const int32_t *blocks, int block_size, int64_t row_stride, float scale,
                                      float softcap, float *xf, float *kp, const struct bf16_scratch *b) {
    if (w->g >= 0)
        attend_tile(q, out, acc, ml, rows, w->t0, w->t1, w->p, w->g, w->h0, w->h1, heads, group, d, kv, kind, blocks,
                    block_size, row_stride, scale, softcap, xf, kp, b);
    else
        attend_row(q, out, acc, ml, &rows[w->t0], w->t0, w->p, w->h0, w->h1, heads, group, d, kv, kind, blocks,
                   block_size, row_stride, scale, softcap, kp != NULL);
}

/* Whether paged_attention's `bf16` can run here: 1 where the CPU has AVX512_BF16, else 0. */
int attention_bf16_supported(void) {
    static int known = -1;
    if (known < 0)
        known = bf16_supported();
    return known;
}

/* Returns 0, or -1 when the partitions' scratch cannot be allocated (nothing written then).
 * Work items are (query row, partition, part of the heads: head_splits), or for a sequence's
 * several rows (tiled) (tile of rows, partition, KV head). `window` 0: none; `softcap` 0: none.
 * `bf16` (taken only where attention_bf16_supported): every row in tiles with bf16 dot products. */
int paged_attention(const float *q, float *out, int64_t num_tokens, int heads, int kv_heads, int d,
                    const kv_pools *kv, int block_size, const int32_t *block_table, int64_t max_blocks,
                    const int32_t *cu_seqlens_q, const int32_t *seq_lens, int num_seqs, float scale, int64_t window,
                    float softcap, int threads, int bf16) {
    if (cu_seqlens_q[num_seqs] < num_tokens)  /* padding rows past the last sequence: left as they are */
        num_tokens = cu_seqlens_q[num_seqs];
    if (num_tokens <= 0)
        return 0;
    bf16 = bf16 && attention_bf16_supported();
    const int group = heads / kv_heads;
    const int64_t row_stride = (int64_t)kv_heads * d;
    struct row_plan *rows = malloc(sizeof(struct row_plan) * num_tokens);
    if (!rows)
        return -1;
    int64_t parts, slots = plan_rows(rows, num_tokens, cu_seqlens_q, seq_lens, num_seqs, window, &parts);
    const int splits = head_splits(num_tokens, parts, heads, threads);
    const int64_t items = plan_work(rows, num_tokens, cu_seqlens_q, num_seqs, heads, kv_heads, splits, bf16, threads, NULL);
    /* a thread's bf16 scratch: a tile's queries, a chunk's keys, its value pairs (bf16_scratch) */
    const int64_t dp = (d + 31) / 32 * 32, dv = (d + 15) / 16 * 16;
    const int64_t bf16_per = bf16 ? (MAX_TILE_VECS + 2 * KEY_CHUNK) * dp + KEY_CHUNK * dv : 0;
    struct work *work = malloc(sizeof(struct work) * items);
    float *acc = slots > 0 ? malloc(sizeof(float) * slots * heads * d) : NULL;
    float *ml = slots > 0 ? malloc(sizeof(float) * slots * heads * 2) : NULL;
    /* the fp32 tiles and lone rows on zmm registers where the GEMM tiles run with AVX-512 (the same bits) */
    const int zmm = !bf16 && qgemm_isa() == 1;
    const int64_t widened = (int64_t)KEY_CHUNK * d * (zmm ? 2 : 1);  /* a chunk, and its keys' pairs */
    float *xf = aligned_alloc(64, sizeof(float) * widened * threads);  /* each thread's widened chunk: whole cache lines */
    uint16_t *bfs = bf16 ? malloc(sizeof(uint16_t) * bf16_per * threads) : NULL;
    if (!work || !xf || (slots > 0 && (!acc || !ml)) || (bf16 && !bfs)) {
        free(acc), free(ml), free(xf), free(bfs), free(work), free(rows);
        return -1;
    }
    plan_work(rows, num_tokens, cu_seqlens_q, num_seqs, heads, kv_heads, splits, bf16, threads, work);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t it = 0; it < items; it++) {
        const struct work *w = &work[it];
        const struct row_plan *r = &rows[w->t0];
        const int32_t *blocks = block_table + (int64_t)r->seq * max_blocks;
        const int th = omp_get_thread_num();
        float *x = xf + th * widened, *kp = zmm ? x + KEY_CHUNK * d : NULL;
        uint16_t *mine = bfs + th * bf16_per;
        struct bf16_scratch scratch = {(uint32_t *)mine, (uint32_t *)(mine + (MAX_TILE_VECS + KEY_CHUNK) * dp),
                                       mine + MAX_TILE_VECS * dp, mine + (MAX_TILE_VECS + 2 * KEY_CHUNK) * dp};
        const struct bf16_scratch *b = bf16 ? &scratch : NULL;
        if (kv->kind == KV_F16)
            attend_item(q, out, acc, ml, rows, w, heads, group, d, kv, KV_F16, blocks, block_size, row_stride, scale,
                        softcap, x, kp, b);
        else if (kv->kind == KV_I8)
            attend_item(q, out, acc, ml, rows, w, heads, group, d, kv, KV_I8, blocks, block_size, row_stride, scale,
                        softcap, x, kp, b);
        else
            attend_item(q, out, acc, ml, rows, w, heads, group, d, kv, KV_F32, blocks, block_size, row_stride, scale,
                        softcap, x, kp, b);
    }
    if (slots > 0) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t it = 0; it < num_tokens * heads; it++) {
            const struct row_plan *r = &rows[it / heads];
            if (r->parts > 1)
                merge_partitions(r, out + it * d, acc, ml, heads, (int)(it % heads), d);
        }
    }
    free(acc), free(ml), free(xf), free(bfs), free(work), free(rows);
    return 0;
}

/* One (slot, KV head) row of d fp32 values `x` into a pool of `kind` at `slot`: fp32; fp16 rounded to
 * nearest even (as torch); int8 as kv_quant.quantize_kv_ref, bit for bit: scale = absmax / 127,
 * x / scale rounded half away from zero (0 and scale 0 for a zero row). */
static void store_row(void *pool, float *scales, int64_t slot, int kv_heads, int head, const float *x, int d,
                      int kind) {
    const int64_t at = (slot * kv_heads + head) * d;
    if (kind != KV_I8) {
        for (int e = 0; e < d; e += 8) {
            __m256 v = _mm256_loadu_ps(x + e);
            if (kind == KV_F16)
                _mm_storeu_si128((__m128i *)((uint16_t *)pool + at + e), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
            else
                _mm256_storeu_ps((float *)pool + at + e, v);
        }
        return;
    }
    float amax = 0.0f;
    for (int e = 0; e < d; e++)
        amax = fmaxf(amax, fabsf(x[e]));
    const float scale = amax / 127.0f, div = scale > 0.0f ? scale : 1.0f;
    int8_t *row = (int8_t *)pool + at;
    for (int e = 0; e < d; e++) {
        float y = x[e] / div, r = copysignf(floorf(fabsf(y) + 0.5f), y);
        row[e] = (int8_t)fminf(fmaxf(r, -127.0f), 127.0f);
    }
    scales[slot * kv_heads + head] = scale;
}

/* Token t's keys/values `[kv_heads, d]` (fp32; d a multiple of 8) into pool slot slots[t] (-1: padding,
 * skipped), as the pools' kind (store_row). */
void store_kv(const float *k, const float *v, const int64_t *slots, int64_t num_tokens, int kv_heads, int d,
              const kv_pools *kv) {
    const int64_t row = (int64_t)kv_heads * d;
    for (int64_t t = 0; t < num_tokens; t++) {
        if (slots[t] < 0)
            continue;
        for (int h = 0; h < kv_heads; h++) {
            store_row(kv->k, kv->k_scale, slots[t], kv_heads, h, k + t * row + (int64_t)h * d, d, (int)kv->kind);
            store_row(kv->v, kv->v_scale, slots[t], kv_heads, h, v + t * row + (int64_t)h * d, d, (int)kv->kind);
        }
    }
}

/* The attention's inputs from the qkv projection, in one pass: token t's row of qkv holds
 * heads + kv_heads rows of d (q, then k), then kv_heads rows of v. Each q and k head is RMS-normed
 * when `norm_w` ([heads + kv_heads, d]) is given, then rotated: x * cos + partner(x) * sin with
 * the step's tables [tokens, d] (sin signed as decoder.RotaryEmbedding lays it out; partner pairs
 * (i, i + d/2) when `neox`, else (2i, 2i + 1)). q goes to q_out [tokens, heads, d]; k and v go to
 * pool slot slots[t] (-1: padding, not stored), as the pools' kind (store_row). The same products and sums as
 * the torch ops it replaces (built without FMA contraction), so the same bits. d: a multiple of
 * 16, at most 512. */
void rope_store_kv(const float *qkv, int64_t num_tokens, int heads, int kv_heads, int d, const float *norm_w,
                   float eps, const float *cos, const float *sin, int neox, float *q_out, const int64_t *slots,
                   const kv_pools *kv) {
    const int64_t width = (int64_t)(heads + 2 * kv_heads) * d;
    const int kind = (int)kv->kind;
    float buf[512], rot[512];
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *row = qkv + t * width, *c = cos + t * d, *s = sin + t * d;
        for (int h = 0; h < heads + kv_heads; h++) {
            const float *x = row + (int64_t)h * d;
            if (norm_w) {
                __m256 scale = _mm256_set1_ps(rms_inv(x, d, eps));
                for (int i = 0; i < d; i += 8)
                    _mm256_storeu_ps(buf + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), scale),
                                                            _mm256_loadu_ps(norm_w + (int64_t)h * d + i)));
                x = buf;
            }
            if (h >= heads && slots[t] < 0)
                continue;
            float *y = h < heads ? q_out + (t * heads + h) * d : rot;
            for (int i = 0; i < d; i += 8) {
                __m256 v = _mm256_loadu_ps(x + i);
                __m256 partner = neox ? _mm256_loadu_ps(x + (i + d / 2) % d) : _mm256_permute_ps(v, 0xB1);
                _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_mul_ps(v, _mm256_loadu_ps(c + i)),
                                                      _mm256_mul_ps(partner, _mm256_loadu_ps(s + i))));
            }
            if (h >= heads)
                store_row(kv->k, kv->k_scale, slots[t], kv_heads, h - heads, rot, d, kind);
        }
        if (slots[t] >= 0)
            for (int h = 0; h < kv_heads; h++)
                store_row(kv->v, kv->v_scale, slots[t], kv_heads, h, row + (int64_t)(heads + kv_heads + h) * d, d, kind);
    }
}
