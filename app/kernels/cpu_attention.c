/* Paged attention for the fp32 CPU path (x86 with AVX2, FMA and F16C; fp32 or fp16 pools): reads each sequence's keys and
 * values where they lie in the block pool, instead of gathering them into a contiguous copy per
 * layer first (at many sequences the gathers and the batched SDPA cost a large share of a step;
 * docs/tuning.md).
 *
 * Layouts as app/kernels/reference.py: q/out [tokens, heads, D]; pools [blocks, block_size,
 * kv_heads, D]; block_table [seqs, max_blocks]; sequence s owns query rows cu_seqlens_q[s] ..
 * cu_seqlens_q[s+1], the last of its seq_lens[s] positions.
 *
 * Every (query row, head) is computed alone, over its keys in position order, in chunks of
 * KEY_CHUNK keys counted from its first visible key (online softmax across chunks): its result
 * depends on its own row, position and cache contents only, never on the batch around it, how the
 * prompt was chunked, or how the work was split between threads.
 */
#include "cpu_kernels.h"
#include "cpu_simd.h"
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define KEY_CHUNK 32
#define MAX_HEADS 128

/* The eight sums of a[0..7]'s lanes, as one vector. */
static inline __m256 hsum8_ps(const __m256 *a) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Eight pool elements from element i on, as fp32: the pool holds fp32, or fp16 when `f16`. */
static inline __m256 load8(const void *pool, int64_t i, int f16) {
    if (f16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)pool + i)));
    return _mm256_loadu_ps((const float *)pool + i);
}

/* Eight fp32 values into a pool at element i: fp32, or fp16 rounded to nearest even (as torch). */
static inline void store8(void *pool, int64_t i, __m256 v, int f16) {
    if (f16)
        _mm_storeu_si128((__m128i *)((uint16_t *)pool + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    else
        _mm256_storeu_ps((float *)pool + i, v);
}

/* q . pool[i .. i+n), n a multiple of 8. */
static inline float dot_pool(const float *q, const void *pool, int64_t i, int n, int f16) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int e = 0;
    for (; e + 16 <= n; e += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + e), load8(pool, i + e, f16), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + e + 8), load8(pool, i + e + 8, f16), s1);
    }
    if (e < n)
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + e), load8(pool, i + e, f16), s0);
    return hsum_ps(_mm256_add_ps(s0, s1));
}

/* y[0..d) += sum over keys j < n of p[j] * pool[off[j] + kv ..], keys in order: 64 elements of y
 * stay in registers while the chunk's values stream past (adding into memory a key at a time
 * loaded and stored y once per key). Each element's fmas come in the same order either way. */
static inline void weigh_values(float *y, const float *p, const void *pool, const int64_t *off, int64_t kv, int n,
                                int d, int f16) {
    for (int e0 = 0; e0 < d; e0 += 64) {
        if (e0 + 64 <= d) {
            __m256 acc[8];
            for (int u = 0; u < 8; u++)
                acc[u] = _mm256_loadu_ps(y + e0 + 8 * u);
            for (int j = 0; j < n; j++) {
                __m256 pj = _mm256_set1_ps(p[j]);
                for (int u = 0; u < 8; u++)
                    acc[u] = _mm256_fmadd_ps(pj, load8(pool, off[j] + kv + e0 + 8 * u, f16), acc[u]);
            }
            for (int u = 0; u < 8; u++)
                _mm256_storeu_ps(y + e0 + 8 * u, acc[u]);
        } else {
            for (int e = e0; e < d; e += 8) {
                __m256 acc = _mm256_loadu_ps(y + e);
                for (int j = 0; j < n; j++)
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), load8(pool, off[j] + kv + e, f16), acc);
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

/* Scores (times `scale`) of two query heads that read the same KV head against keys j .. j+3:
 * each key vector is loaded (and widened from fp16) once for both. */
static inline void scores_pair(const float *qa, const float *qb, const void *pool, const int64_t *off, int64_t kv,
                               int d, int f16, float scale, float *sa, float *sb) {
    __m256 a[4], b[4];
    for (int u = 0; u < 4; u++)
        a[u] = b[u] = _mm256_setzero_ps();
    for (int e = 0; e < d; e += 8) {
        __m256 qva = _mm256_loadu_ps(qa + e), qvb = _mm256_loadu_ps(qb + e);
        for (int u = 0; u < 4; u++) {
            __m256 k = load8(pool, off[u] + kv + e, f16);
            a[u] = _mm256_fmadd_ps(qva, k, a[u]);
            b[u] = _mm256_fmadd_ps(qvb, k, b[u]);
        }
    }
    _mm_storeu_ps(sa, _mm_mul_ps(hsum4_ps(a), _mm_set1_ps(scale)));
    _mm_storeu_ps(sb, _mm_mul_ps(hsum4_ps(b), _mm_set1_ps(scale)));
}

/* weigh_values for two query heads of one KV head: each value vector loaded once for both; every
 * element's fmas in the same order as weigh_values's. */
static inline void weigh_values_pair(float *ya, float *yb, const float *pa, const float *pb, const void *pool,
                                     const int64_t *off, int64_t kv, int n, int d, int f16) {
    int e0 = 0;
    for (; e0 + 32 <= d; e0 += 32) {
        __m256 a[4], b[4];
        for (int u = 0; u < 4; u++)
            a[u] = _mm256_loadu_ps(ya + e0 + 8 * u), b[u] = _mm256_loadu_ps(yb + e0 + 8 * u);
        for (int j = 0; j < n; j++) {
            __m256 wa = _mm256_set1_ps(pa[j]), wb = _mm256_set1_ps(pb[j]);
            for (int u = 0; u < 4; u++) {
                __m256 v = load8(pool, off[j] + kv + e0 + 8 * u, f16);
                a[u] = _mm256_fmadd_ps(wa, v, a[u]);
                b[u] = _mm256_fmadd_ps(wb, v, b[u]);
            }
        }
        for (int u = 0; u < 4; u++)
            _mm256_storeu_ps(ya + e0 + 8 * u, a[u]), _mm256_storeu_ps(yb + e0 + 8 * u, b[u]);
    }
    if (e0 < d) {
        int64_t rest[KEY_CHUNK];
        for (int j = 0; j < n; j++) rest[j] = off[j] + e0;
        weigh_values(ya + e0, pa, pool, rest, kv, n, d - e0, f16);
        weigh_values(yb + e0, pb, pool, rest, kv, n, d - e0, f16);
    }
}

/* Whether query head h and the next (`more`: one is there) read the same KV head. */
static inline int pairs_with_next(int h, int more, int group) { return more && (h + 1) / group == h / group; }

/* Query heads h0..h1 of one row (q/out: the row's [heads, d]) attend to positions first..last;
 * query head h reads KV head h / group. All the row's heads walk the keys together: each key row
 * of the pool (every KV head side by side) is read from memory once, not once per KV head. */
static void attend(const float *q, float *out, int h0, int h1, int group, int d, const void *k_pool,
                   const void *v_pool, int f16, const int32_t *blocks, int block_size, int64_t row_stride,
                   int64_t first, int64_t last, float scale, float softcap) {
    const int64_t esize = f16 ? 2 : 4;
    float m[MAX_HEADS], l[MAX_HEADS], s[MAX_HEADS][KEY_CHUNK];
    int64_t off[KEY_CHUNK];
    int nh = h1 - h0;
    for (int i = 0; i < nh; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
        memset(out + (int64_t)(h0 + i) * d, 0, sizeof(float) * d);
    }
    for (int64_t c0 = first; c0 <= last; c0 += KEY_CHUNK) {
        int n = last - c0 + 1 < KEY_CHUNK ? (int)(last - c0 + 1) : KEY_CHUNK;
        for (int j = 0; j < n; j++) {
            int64_t pos = c0 + j;
            off[j] = ((int64_t)blocks[pos / block_size] * block_size + pos % block_size) * row_stride;
        }
        /* The next chunk's key and value rows are requested now and arrive while this one is
         * computed: the rows are scattered over the pool, beyond the hardware prefetcher's reach. */
        for (int64_t pos = c0 + KEY_CHUNK; pos < c0 + 2 * KEY_CHUNK && pos <= last; pos++) {
            int64_t o = ((int64_t)blocks[pos / block_size] * block_size + pos % block_size) * row_stride;
            for (int64_t e = (int64_t)(h0 / group) * d; e < (int64_t)((h1 - 1) / group + 1) * d; e += 64 / esize) {
                _mm_prefetch((const char *)k_pool + (o + e) * esize, _MM_HINT_T0);
                _mm_prefetch((const char *)v_pool + (o + e) * esize, _MM_HINT_T0);
            }
        }
        /* Two query heads of one KV head at a time where the group has them (GQA): the key rows
         * they share are read once. A lone head (or one left over) alone. */
        for (int i = 0; i < nh;) {
            int h = h0 + i, pair = pairs_with_next(h, i + 1 < nh, group);
            const float *qh = q + (int64_t)h * d;
            const int64_t kv = (int64_t)(h / group) * d;
            int j = 0;
            for (; j + 8 <= n; j += 8) {  /* eight keys' dot products side by side, summed at once */
                if (pair) {
                    scores_pair(qh, qh + d, k_pool, off + j, kv, d, f16, scale, &s[i][j], &s[i + 1][j]);
                    scores_pair(qh, qh + d, k_pool, off + j + 4, kv, d, f16, scale, &s[i][j + 4], &s[i + 1][j + 4]);
                    continue;
                }
                __m256 acc[8];
                for (int u = 0; u < 8; u++)
                    acc[u] = _mm256_setzero_ps();
                for (int e = 0; e < d; e += 8) {
                    __m256 qv = _mm256_loadu_ps(qh + e);
                    for (int u = 0; u < 8; u++)
                        acc[u] = _mm256_fmadd_ps(qv, load8(k_pool, off[j + u] + kv + e, f16), acc[u]);
                }
                _mm256_storeu_ps(&s[i][j], _mm256_mul_ps(hsum8_ps(acc), _mm256_set1_ps(scale)));
            }
            for (int k = i; k <= i + pair; k++) {
                for (int jj = j; jj < n; jj++)
                    s[k][jj] = dot_pool(q + (int64_t)(h0 + k) * d, k_pool, off[jj] + kv, d, f16) * scale;
                if (softcap > 0.0f)
                    for (int jj = 0; jj < n; jj++)
                        s[k][jj] = softcap * tanhf(s[k][jj] / softcap);
            }
            i += 1 + pair;
        }
        for (int i = 0; i < nh; i++) {
            float mx = m[i];
            for (int j = 0; j < n; j++)
                mx = s[i][j] > mx ? s[i][j] : mx;
            if (m[i] != mx) {  /* rescale what earlier chunks summed (nothing for the first) */
                float alpha = expf(m[i] - mx);
                l[i] *= alpha;
                scale_vec(out + (int64_t)(h0 + i) * d, alpha, d);
                m[i] = mx;
            }
            for (int j = n; j < (n + 7) / 8 * 8; j++)
                s[i][j] = -INFINITY;
            __m256 vmx = _mm256_set1_ps(mx);
            for (int j = 0; j < n; j += 8)
                _mm256_storeu_ps(&s[i][j], exp_ps(_mm256_sub_ps(_mm256_loadu_ps(&s[i][j]), vmx)));
            float sum = 0.0f;
            for (int j = 0; j < n; j++)
                sum += s[i][j];
            l[i] += sum;
        }
        for (int i = 0; i < nh;) {
            int h = h0 + i, pair = pairs_with_next(h, i + 1 < nh, group);
            float *y = out + (int64_t)h * d;
            if (pair)
                weigh_values_pair(y, y + d, s[i], s[i + 1], v_pool, off, (int64_t)(h / group) * d, n, d, f16);
            else
                weigh_values(y, s[i], v_pool, off, (int64_t)(h / group) * d, n, d, f16);
            i += 1 + pair;
        }
    }
    for (int i = 0; i < nh; i++)
        scale_vec(out + (int64_t)(h0 + i) * d, 1.0f / l[i], d);
}

/* Work items are (query row, part): `splits` parts divide a row's query heads, so a batch of one
 * decode still spreads over the threads. The pools hold fp32, or fp16 when `f16`. `window` 0:
 * none; `softcap` 0: none. */
void paged_attention(const float *q, float *out, int64_t num_tokens, int heads, int kv_heads, int d,
                         const void *k_cache, const void *v_cache, int f16, int block_size, const int32_t *block_table,
                         int64_t max_blocks, const int32_t *cu_seqlens_q, const int32_t *seq_lens, int num_seqs,
                         float scale, int64_t window, float softcap, int splits, int threads) {
    if (cu_seqlens_q[num_seqs] < num_tokens)  /* padding rows past the last sequence: left as they are */
        num_tokens = cu_seqlens_q[num_seqs];
    int group = heads / kv_heads;
    int per = (heads + splits - 1) / splits;
    int64_t items = num_tokens * splits;
    int64_t row_stride = (int64_t)kv_heads * d;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t it = 0; it < items; it++) {
        int64_t t = it / splits;
        int h0 = (int)(it % splits) * per;
        int h1 = h0 + per < heads ? h0 + per : heads;
        if (h0 >= h1)
            continue;
        int lo = 0, hi = num_seqs - 1;  /* the last sequence whose rows start at or before t */
        while (lo < hi) {
            int mid = (lo + hi + 1) / 2;
            if (cu_seqlens_q[mid] <= t) lo = mid; else hi = mid - 1;
        }
        int64_t pos = (int64_t)seq_lens[lo] - (cu_seqlens_q[lo + 1] - cu_seqlens_q[lo]) + (t - cu_seqlens_q[lo]);
        int64_t first = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
        int64_t row = t * heads * d;
        attend(q + row, out + row, h0, h1, group, d, k_cache, v_cache, f16, block_table + lo * max_blocks,
               block_size, row_stride, first, pos, scale, softcap);
    }
}

/* Token t's keys/values `[kv_heads * D]` (fp32; `row` a multiple of 8) into pool slot slots[t]
 * (-1: padding, skipped), as fp32 or, when `f16`, rounded to fp16 (to nearest even, as torch). */
void store_kv(const float *k, const float *v, const int64_t *slots, int64_t num_tokens, int64_t row,
              void *k_cache, void *v_cache, int f16) {
    for (int64_t t = 0; t < num_tokens; t++) {
        if (slots[t] < 0)
            continue;
        for (int64_t e = 0; e < row; e += 8) {
            store8(k_cache, slots[t] * row + e, _mm256_loadu_ps(k + t * row + e), f16);
            store8(v_cache, slots[t] * row + e, _mm256_loadu_ps(v + t * row + e), f16);
        }
    }
}

/* The attention's inputs from the qkv projection, in one pass: token t's row of qkv holds
 * heads + kv_heads rows of d (q, then k), then kv_heads rows of v. Each q and k head is RMS-normed
 * when `norm_w` ([heads + kv_heads, d]) is given, then rotated: x * cos + partner(x) * sin with
 * the step's tables [tokens, d] (sin signed as decoder.RotaryEmbedding lays it out; partner pairs
 * (i, i + d/2) when `neox`, else (2i, 2i + 1)). q goes to q_out [tokens, heads, d]; k and v go to
 * pool slot slots[t] (-1: padding, not stored), as the pool's type. The same products and sums as
 * the torch ops it replaces (built without FMA contraction), so the same bits. d: a multiple of
 * 16, at most 512. */
void rope_store_kv(const float *qkv, int64_t num_tokens, int heads, int kv_heads, int d, const float *norm_w,
                   float eps, const float *cos, const float *sin, int neox, float *q_out, const int64_t *slots,
                   void *k_cache, void *v_cache, int f16) {
    const int64_t width = (int64_t)(heads + 2 * kv_heads) * d, kv_row = (int64_t)kv_heads * d;
    float buf[512];
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
            for (int i = 0; i < d; i += 8) {
                __m256 v = _mm256_loadu_ps(x + i);
                __m256 partner = neox ? _mm256_loadu_ps(x + (i + d / 2) % d) : _mm256_permute_ps(v, 0xB1);
                __m256 r = _mm256_add_ps(_mm256_mul_ps(v, _mm256_loadu_ps(c + i)),
                                         _mm256_mul_ps(partner, _mm256_loadu_ps(s + i)));
                if (h < heads)
                    _mm256_storeu_ps(q_out + (t * heads + h) * d + i, r);
                else
                    store8(k_cache, slots[t] * kv_row + (int64_t)(h - heads) * d + i, r, f16);
            }
        }
        if (slots[t] >= 0)
            for (int64_t e = 0; e < kv_row; e += 8)
                store8(v_cache, slots[t] * kv_row + e, _mm256_loadu_ps(row + (int64_t)(heads + kv_heads) * d + e), f16);
    }
}
