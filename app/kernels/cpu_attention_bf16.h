/* The tiles' dot products in bf16, for CPUs with AVX512_BF16 (vdpbf16ps), included by cpu_attention.c
 * (only paged_attention's `bf16` choice runs them; never AMX). Queries and keys are rounded to bf16
 * (nearest even) for Q.K, the softmax's weights and the values for P.V; every product is exact in
 * fp32 and summed in fp32. The softmax itself (max, exp, sums, rescaling) is the fp32 path's.
 *
 * Each score and each output element is summed in one fixed order whatever vectors or keys share the
 * registers with it (a score: its 16 lanes over the head size in steps of 32, then hsum4_ps's tree;
 * an output element: key pairs in order, the pair's odd key first, as vdpbf16ps adds them), so a row
 * computed in a tile, alone, or split by heads gives the same bits. reference_bf16.py is the torch
 * statement of this arithmetic. */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512bf16")

/* A thread's bf16 scratch: a tile's queries (MAX_TILE_VECS rows of dp), a chunk's keys (KEY_CHUNK rows
 * of dp) and value pairs (KEY_CHUNK / 2 pairs of dv). dp: d rounded up to 32; dv: to 16. */
struct bf16_scratch {
    uint16_t *q, *k, *v;
};

static inline int round_up(int x, int m) {
    return (x + m - 1) / m * m;
}

/* The lanes of elements e..e+15 that lie below d. */
static inline __mmask16 lanes16(int e, int d) {
    return e + 16 <= d ? (__mmask16)0xFFFF : e < d ? (__mmask16)((1u << (d - e)) - 1) : (__mmask16)0;
}

static inline __m512 load16(const float *x, int e, int d) {
    return _mm512_maskz_loadu_ps(lanes16(e, d), x + e);
}

/* Rows 0..n-1 of d floats (src, stride d) rounded to bf16 into rows of dp at dst, zeros past d;
 * rows n..n_pad-1 all zeros (the last four keys' padding). */
static inline void bf16_rows(uint16_t *dst, const float *src, int n, int n_pad, int d, int dp) {
    for (int j = 0; j < n_pad; j++)
        for (int e = 0; e < dp; e += 32) {
            __m512 lo = _mm512_setzero_ps(), hi = lo;
            if (j < n)
                lo = load16(src + (int64_t)j * d, e, d), hi = load16(src + (int64_t)j * d, e + 16, d);
            _mm512_storeu_si512(dst + (int64_t)j * dp + e, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
}

/* Keys 0..n-1's values (fp32 rows of d at xf) as pairs: pair i's elements e..e+15 are one 64-byte
 * line, v[2i][e], v[2i+1][e], v[2i][e+1], ...; a missing odd key and elements past d are 0. */
static inline void bf16_pairs(uint16_t *dst, const float *xf, int n, int d, int dv) {
    static const uint16_t interleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                            8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i idx = _mm512_loadu_si512(interleave);
    for (int i = 0; 2 * i < n; i++)
        for (int e = 0; e < dv; e += 16) {
            __m512 a = load16(xf + (int64_t)2 * i * d, e, d);
            __m512 b = 2 * i + 1 < n ? load16(xf + (int64_t)(2 * i + 1) * d, e, d) : _mm512_setzero_ps();
            __m512i w = (__m512i)_mm512_cvtne2ps_pbh(b, a);
            _mm512_storeu_si512(dst + ((int64_t)i * dv + e) * 2, _mm512_permutexvar_epi16(idx, w));
        }
}

/* Scores (times sc) of NV query vectors (bf16 rows qb[v]) against keys j..j+3 (bf16 rows of dp at kb). */
static ALWAYS_INLINE void scores4_bf16(const uint16_t *const *qb, const int NV, const uint16_t *kb, int dp,
                                       float sc, float *const *ss, int j) {
    __m512 a[4][4];
    for (int v = 0; v < NV; v++)
        for (int u = 0; u < 4; u++)
            a[v][u] = _mm512_setzero_ps();
    for (int e = 0; e < dp; e += 32) {
        __m512bh k[4];
        for (int u = 0; u < 4; u++)
            k[u] = (__m512bh)_mm512_loadu_si512(kb + (int64_t)(j + u) * dp + e);
        for (int v = 0; v < NV; v++) {
            __m512bh x = (__m512bh)_mm512_loadu_si512(qb[v] + e);
            for (int u = 0; u < 4; u++)
                a[v][u] = _mm512_dpbf16_ps(a[v][u], x, k[u]);
        }
    }
    for (int v = 0; v < NV; v++) {
        __m256 h[4];
        for (int u = 0; u < 4; u++)
            h[u] = _mm256_add_ps(_mm512_castps512_ps256(a[v][u]),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[v][u]), 1)));
        _mm_storeu_ps(ss[v] + j, _mm_mul_ps(hsum4_ps(h), _mm_set1_ps(sc)));
    }
}

/* Scores of vectors 0..nv-1 against keys 0..n-1 (and up to the next four: kb holds them, as zeros
 * past the chunk), four vectors at a time. */
static ALWAYS_INLINE void tile_scores_bf16(const uint16_t *const *qb, float *const *ss, int nv, const uint16_t *kb,
                                           int n, int dp, float sc) {
    int v = 0;
    for (; v + 4 <= nv; v += 4)
        for (int j = 0; j < n; j += 4)
            scores4_bf16(qb + v, 4, kb, dp, sc, ss + v, j);
    for (int j = 0; j < n; j += 4)
        switch (nv - v) {
        case 3: scores4_bf16(qb + v, 3, kb, dp, sc, ss + v, j); break;
        case 2: scores4_bf16(qb + v, 2, kb, dp, sc, ss + v, j); break;
        case 1: scores4_bf16(qb + v, 1, kb, dp, sc, ss + v, j); break;
        default: break;
        }
}

/* Elements e0 .. e0 + 16 * NB of NV vectors' outputs += the weight pairs pp[v][0..pairs) times the
 * value pairs, pair by pair: the outputs stay in registers while the chunk's values stream past. */
static ALWAYS_INLINE void values_block_bf16(float *const *ys, const uint32_t (*pp)[KEY_CHUNK / 2], const int NV,
                                            const uint16_t *vb, int pairs, int d, int dv, int e0, const int NB) {
    __m512 a[4][4];
    for (int v = 0; v < NV; v++)
        for (int u = 0; u < NB; u++)
            a[v][u] = _mm512_maskz_loadu_ps(lanes16(e0 + 16 * u, d), ys[v] + e0 + 16 * u);
    for (int i = 0; i < pairs; i++) {
        __m512bh w[4];
        for (int v = 0; v < NV; v++)
            w[v] = (__m512bh)_mm512_set1_epi32((int)pp[v][i]);
        for (int u = 0; u < NB; u++) {
            __m512bh x = (__m512bh)_mm512_loadu_si512(vb + ((int64_t)i * dv + e0 + 16 * u) * 2);
            for (int v = 0; v < NV; v++)
                a[v][u] = _mm512_dpbf16_ps(a[v][u], x, w[v]);
        }
    }
    for (int v = 0; v < NV; v++)
        for (int u = 0; u < NB; u++)
            _mm512_mask_storeu_ps(ys[v] + e0 + 16 * u, lanes16(e0 + 16 * u, d), a[v][u]);
}

static ALWAYS_INLINE void values_bf16(float *const *ys, const uint32_t (*pp)[KEY_CHUNK / 2], const int NV,
                                      const uint16_t *vb, int pairs, int d, int dv) {
    int e0 = 0;
    for (; e0 + 64 <= dv; e0 += 64)
        values_block_bf16(ys, pp, NV, vb, pairs, d, dv, e0, 4);
    for (; e0 < dv; e0 += 16)
        values_block_bf16(ys, pp, NV, vb, pairs, d, dv, e0, 1);
}

/* ys[v] += vectors 0..nv-1's weights over keys 0..n-1 (ss[v], 0 past a diagonal row's keys) as bf16
 * pairs, times the chunk's value pairs; four vectors at a time. */
static ALWAYS_INLINE void tile_values_bf16(float *const *ys, float *const *ss, int nv, const uint16_t *vb, int n,
                                           int d, int dv) {
    uint32_t pp[MAX_TILE_VECS][KEY_CHUNK / 2];
    for (int v = 0; v < nv; v++) {
        __m512 lo = _mm512_maskz_loadu_ps(lanes16(0, n), ss[v]), hi = _mm512_maskz_loadu_ps(lanes16(16, n), ss[v] + 16);
        _mm512_storeu_si512(pp[v], (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
    const int pairs = (n + 1) / 2;
    int v = 0;
    for (; v + 4 <= nv; v += 4)
        values_bf16(ys + v, pp + v, 4, vb, pairs, d, dv);
    switch (nv - v) {
    case 3: values_bf16(ys + v, pp + v, 3, vb, pairs, d, dv); break;
    case 2: values_bf16(ys + v, pp + v, 2, vb, pairs, d, dv); break;
    case 1: values_bf16(ys + v, pp + v, 1, vb, pairs, d, dv); break;
    default: break;
    }
}

/* tile_chunk with bf16 dot products. */
static ALWAYS_INLINE void tile_chunk_bf16_kind(const uint16_t *const *qb, float *const *ys, float *const *ss, float *m,
                                               float *l, const int64_t *lasts, int nr, int per, int64_t c0, int n,
                                               const float *ksc, const float *vsc, const kv_pools *kv,
                                               const int64_t *off, int64_t kvo, int kind, int d, float scale,
                                               float softcap, float *xf, const struct bf16_scratch *b) {
    int r_c;
    const int r_f = tile_rows_seeing(lasts, nr, c0, n, &r_c);
    const int dp = round_up(d, 32), dv = round_up(d, 16);
    const float sc = kind == KV_I8 ? 1.0f : scale;  /* as chunk_scores */
    widen_chunk(xf, kv->k, off, kvo, n, d, kind);
    bf16_rows(b->k, xf, n, round_up(n, 4), d, dp);
    for (int r = r_c; r < r_f; r++)
        tile_scores_bf16(qb + r * per, ss + r * per, per, b->k, keys_seen(lasts, r, r_f, c0, n), dp, sc);
    tile_scores_bf16(qb + r_f * per, ss + r_f * per, (nr - r_f) * per, b->k, n, dp, sc);
    tile_softmax(ys, ss, m, l, lasts, nr, per, r_c, r_f, c0, n, ksc, vsc, kind, d, scale, softcap);
    widen_chunk(xf, kv->v, off, kvo, n, d, kind);
    bf16_pairs(b->v, xf, n, d, dv);
    for (int r = r_c; r < r_f; r++)
        tile_values_bf16(ys + r * per, ss + r * per, per, b->v, keys_seen(lasts, r, r_f, c0, n), d, dv);
    tile_values_bf16(ys + r_f * per, ss + r_f * per, (nr - r_f) * per, b->v, n, d, dv);
}

/* tile_chunk_bf16_kind with the pool's kind a constant in the loops. */
static __attribute__((noinline)) void tile_chunk_bf16(const uint16_t *const *qb, float *const *ys, float *const *ss,
                                                      float *m, float *l, const int64_t *lasts, int nr, int per,
                                                      int64_t c0, int n, const float *ksc, const float *vsc,
                                                      const kv_pools *kv, const int64_t *off, int64_t kvo, int kind,
                                                      int d, float scale, float softcap, float *xf,
                                                      const struct bf16_scratch *b) {
    if (kind == KV_F16)
        tile_chunk_bf16_kind(qb, ys, ss, m, l, lasts, nr, per, c0, n, ksc, vsc, kv, off, kvo, KV_F16, d, scale,
                             softcap, xf, b);
    else if (kind == KV_I8)
        tile_chunk_bf16_kind(qb, ys, ss, m, l, lasts, nr, per, c0, n, ksc, vsc, kv, off, kvo, KV_I8, d, scale,
                             softcap, xf, b);
    else
        tile_chunk_bf16_kind(qb, ys, ss, m, l, lasts, nr, per, c0, n, ksc, vsc, kv, off, kvo, KV_F32, d, scale,
                             softcap, xf, b);
}

/* The tile's nv query vectors rounded to bf16 rows of dp in the scratch; qb[v] points at each. */
static __attribute__((noinline)) void bf16_queries(const uint16_t **qb, const float *const *qs, int nv, int d,
                                                   const struct bf16_scratch *b) {
    const int dp = round_up(d, 32);
    for (int v = 0; v < nv; v++) {
        bf16_rows(b->q + (int64_t)v * dp, qs[v], 1, 1, d, dp);
        qb[v] = b->q + (int64_t)v * dp;
    }
}

#pragma GCC pop_options

/* Whether this CPU runs the bf16 tiles: AVX512_BF16 and the AVX-512 they use, as the CPU (and the OS,
 * for the registers) confirms; a listed feature can fault in some VMs. */
static int bf16_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512bf16");
}
