/* The fp32 tiles' and lone rows' dot products and value sums on zmm registers, for CPUs whose GEMM
 * tiles run with AVX-512 (qgemm_isa), included by cpu_attention.c. Twice the lanes an instruction of
 * the ymm loops (tile_scores, tile_values; chunk_scores, weigh_values), and the same bits: each lane
 * runs the same fma sequence as a lane of those loops, and each score's eight lanes are summed in
 * hsum4_ps's tree ((0+1)+(2+3)) + ((4+5)+(6+7)).
 *
 * A score's lanes: of each group of 8 keys, pair p holds keys p and p+4, element block e (8 floats)
 * of one beside the other's, so a zmm register holds two keys' blocks and a broadcast query block
 * meets both. The tiles widen their chunk's keys into such pairs once (widen_pairs); a lone row
 * loads each pair straight from the pool (load_pair_avx512). */

/* Keys 0..n8-1 (whole eights) of the row-major widened chunk kf, as pairs at kp: group j0 (8 keys),
 * pair p, block e at kp + j0 d + 2 p d + 2 e, key j0+p's first, then key j0+p+4's. */
static inline void widen_pairs(float *kp, const float *kf, int n8, int d) {
    for (int j0 = 0; j0 < n8; j0 += 8)
        for (int p = 0; p < 4; p++) {
            float *to = kp + (int64_t)j0 * d + 2 * p * d;
            const float *a = kf + (int64_t)(j0 + p) * d, *b = kf + (int64_t)(j0 + p + 4) * d;
            for (int e = 0; e < d; e += 8) {
                _mm256_storeu_ps(to + 2 * e, _mm256_loadu_ps(a + e));
                _mm256_storeu_ps(to + 2 * e + 8, _mm256_loadu_ps(b + e));
            }
        }
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl")

/* Eight floats in both halves of a zmm (one load). */
static inline __m512 bcast8_avx512(const float *p) {
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(p))));
}

/* The eight keys' sums (in key order) of a[p] = [key p's 8 lanes | key p+4's], each in hsum4_ps's
 * tree: pair sums, then the halves' sums, then first half + second half. */
static inline __m256 hsum8_pairs(const __m512 *a) {
    const __m512 h01 = _mm512_add_ps(_mm512_shuffle_ps(a[0], a[1], 0x88), _mm512_shuffle_ps(a[0], a[1], 0xDD));
    const __m512 h23 = _mm512_add_ps(_mm512_shuffle_ps(a[2], a[3], 0x88), _mm512_shuffle_ps(a[2], a[3], 0xDD));
    /* 128-bit lanes: keys 0-3's first halves, their second halves, then keys 4-7's */
    const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(h01, h23, 0x88), _mm512_shuffle_ps(h01, h23, 0xDD));
    return _mm512_castps512_ps256(_mm512_add_ps(_mm512_shuffle_f32x4(u, u, 0x08), _mm512_shuffle_f32x4(u, u, 0x0D)));
}

/* Scores (times sc) of Q query vectors (Q <= 6) against the 8 keys of pair group kp, into ss[i][j..j+7]:
 * 4 x Q accumulators, each key block loaded once for the Q vectors. */
static ALWAYS_INLINE void scores8_avx512(const float *const *qs, const int Q, const float *kp, int d, float sc,
                                     float *const *ss, int j) {
    __m512 a[6][4];
    for (int i = 0; i < Q; i++)
        for (int p = 0; p < 4; p++)
            a[i][p] = _mm512_setzero_ps();
    for (int e = 0; e < d; e += 8) {
        __m512 k[4];
        for (int p = 0; p < 4; p++) {
            k[p] = _mm512_loadu_ps(kp + 2 * p * d + 2 * e);
            __asm__("" : "+v"(k[p])); /* loaded once for the Q vectors, not folded into each fma */
        }
        for (int i = 0; i < Q; i++) {
            const __m512 q = bcast8_avx512(qs[i] + e);
            for (int p = 0; p < 4; p++)
                a[i][p] = _mm512_fmadd_ps(q, k[p], a[i][p]);
        }
    }
    for (int i = 0; i < Q; i++)
        _mm256_storeu_ps(ss[i] + j, _mm256_mul_ps(hsum8_pairs(a[i]), _mm256_set1_ps(sc)));
}

/* tile_scores with the whole eights of keys from the pairs kp (the rest from kf, as tile_scores). */
static __attribute__((noinline)) void tile_scores_avx512(const float *const *qs, float *const *ss, int nv,
                                                      const float *kf, const float *kp, const int64_t *soff, int n,
                                                      int d, float sc) {
    const int n8 = n / 8 * 8;
    int v = 0;
    for (; v + 6 <= nv; v += 6)
        for (int j = 0; j < n8; j += 8)
            scores8_avx512(qs + v, 6, kp + (int64_t)j * d, d, sc, ss + v, j);
    for (; v + 3 <= nv; v += 3)
        for (int j = 0; j < n8; j += 8)
            scores8_avx512(qs + v, 3, kp + (int64_t)j * d, d, sc, ss + v, j);
    for (int j = 0; v + 2 == nv && j < n8; j += 8)
        scores8_avx512(qs + v, 2, kp + (int64_t)j * d, d, sc, ss + v, j);
    for (int j = 0; v + 1 == nv && j < n8; j += 8)
        scores8_avx512(qs + v, 1, kp + (int64_t)j * d, d, sc, ss + v, j);
    for (v = 0; v < nv; v++)
        for (int j = n8; j < n; j++)
            ss[v][j] = dot_pool(qs[v], kf, soff[j], d, KV_F32) * sc;
}

/* ys[i][e0 .. e0+63] += the weights ps[i][0..n) times the widened chunk's values, keys in order, for
 * Q vectors (Q <= 3): weigh_values' fmas, 16 lanes a register. */
static ALWAYS_INLINE void values64_avx512(float *const *ys, float *const *ps, const int Q, const float *vf,
                                      const int64_t *soff, int n, int e0) {
    __m512 a[3][4];
    for (int i = 0; i < Q; i++)
        for (int u = 0; u < 4; u++)
            a[i][u] = _mm512_loadu_ps(ys[i] + e0 + 16 * u);
    for (int j = 0; j < n; j++) {
        const float *v = vf + soff[j] + e0;
        __m512 x[4];
        for (int u = 0; u < 4; u++)
            x[u] = _mm512_loadu_ps(v + 16 * u);
        for (int i = 0; i < Q; i++) {
            const __m512 w = _mm512_set1_ps(ps[i][j]);
            for (int u = 0; u < 4; u++)
                a[i][u] = _mm512_fmadd_ps(w, x[u], a[i][u]);
        }
    }
    for (int i = 0; i < Q; i++)
        for (int u = 0; u < 4; u++)
            _mm512_storeu_ps(ys[i] + e0 + 16 * u, a[i][u]);
}

/* Q vectors' values: whole 64-element blocks here, the rest as weigh_values_tail weighs it. */
static ALWAYS_INLINE void values_avx512(float *const *ys, float *const *ps, const int Q, const float *vf,
                                    const int64_t *soff, int n, int d) {
    int e0 = 0;
    for (; e0 + 64 <= d; e0 += 64)
        values64_avx512(ys, ps, Q, vf, soff, n, e0);
    weigh_values_tail((float **)ys, (const float **)ps, Q, e0, vf, soff, 0, n, d, KV_F32);
}

/* tile_values on zmm registers. */
static __attribute__((noinline)) void tile_values_avx512(float *const *ys, float *const *ps, int nv, const float *vf,
                                                      const int64_t *soff, int n, int d) {
    int v = 0;
    for (; v + 3 <= nv; v += 3)
        values_avx512(ys + v, ps + v, 3, vf, soff, n, d);
    if (v + 2 == nv)
        values_avx512(ys + v, ps + v, 2, vf, soff, n, d);
    else if (v + 1 == nv)
        values_avx512(ys + v, ps + v, 1, vf, soff, n, d);
}

/* e^x on 16 lanes: exp_ps's operations and constants (cpu_simd.h), lane by lane: the same bits. */
static inline __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(EXP_LO);
    const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(EXP_HI));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < 6; i++)
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_POLY[i]));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps((__mmask16)~under, p, _mm512_castsi512_ps(e));
}

/* The lanes of elements e..e+15 below n. */
static inline __mmask16 below16(int e, int n) {
    return e + 16 <= n ? (__mmask16)0xFFFF : e < n ? (__mmask16)((1u << (n - e)) - 1) : (__mmask16)0;
}

/* chunk_exp on 16 lanes (n <= KEY_CHUNK): the same max, rescaling and exps, so the same bits. */
static __attribute__((noinline)) void chunk_exp_avx512(float *srow, int n, float *m, float *l, float *y, int d) {
    const int n8 = (n + 7) / 8 * 8;
    const __m512 none = _mm512_set1_ps(-INFINITY);
    __m512 vm = _mm512_set1_ps(*m);
    for (int j = 0; j < n8; j += 16)
        vm = _mm512_max_ps(vm, _mm512_mask_loadu_ps(none, below16(j, n), srow + j));
    const float mx = _mm512_reduce_max_ps(vm);
    if (*m != mx) { /* rescale what earlier chunks summed (nothing for the first) */
        const float alpha = expf(*m - mx);
        const __m512 va = _mm512_set1_ps(alpha);
        *l *= alpha;
        for (int e = 0; e < d; e += 16)
            _mm512_mask_storeu_ps(y + e, below16(e, d), _mm512_mul_ps(va, _mm512_maskz_loadu_ps(below16(e, d), y + e)));
        *m = mx;
    }
    const __m512 vmx = _mm512_set1_ps(mx);
    for (int j = 0; j < n8; j += 16)  /* the lanes from n up to n8 (-inf) come out 0, as chunk_exp's */
        _mm512_mask_storeu_ps(srow + j, below16(j, n8),
                              exp16(_mm512_sub_ps(_mm512_mask_loadu_ps(none, below16(j, n), srow + j), vmx)));
}

/* Sixteen pool elements from element i on, as fp32: load8's widening on 16 lanes (exact). */
static ALWAYS_INLINE __m512 load16_avx512(const void *pool, int64_t i, const int kind) {
    if (kind == KV_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)pool + i)));
    if (kind == KV_I8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)pool + i))));
    return _mm512_loadu_ps((const float *)pool + i);
}

/* Pool elements a .. a+7 in lanes 0-7 and b .. b+7 in lanes 8-15, as fp32: two keys' blocks as a pair. */
static ALWAYS_INLINE __m512 load_pair_avx512(const void *pool, int64_t a, int64_t b, const int kind) {
    if (kind == KV_F16) {
        const uint16_t *p = (const uint16_t *)pool;
        return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p + a))),
                                                       _mm_loadu_si128((const __m128i *)(p + b)), 1));
    }
    if (kind == KV_I8) {
        const int8_t *p = (const int8_t *)pool;
        const __m128i x = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(p + a)), _mm_loadl_epi64((const __m128i *)(p + b)));
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(x));
    }
    const float *p = (const float *)pool;
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(p + a))),
                                               _mm256_castps_pd(_mm256_loadu_ps(p + b)), 1));
}

/* One row's scores (chunk_scores' whole eights) straight from the pool: Q query vectors (Q <= 3) of
 * one KV head (at kv in each key row) against keys j .. j+7, pairs (p, p+4) as widen_pairs lays them
 * out, so each score is summed in scores8_avx512's tree, the ymm loops' bits. */
static ALWAYS_INLINE void pool_scores8_avx512(const float *const *qs, const int Q, const void *pool, const int64_t *off,
                                              int64_t kv, int d, const int kind, float sc, float *const *ss, int j) {
    __m512 a[3][4];
    for (int i = 0; i < Q; i++)
        for (int p = 0; p < 4; p++)
            a[i][p] = _mm512_setzero_ps();
    for (int e = 0; e < d; e += 8) {
        __m512 k[4];
        for (int p = 0; p < 4; p++)
            k[p] = load_pair_avx512(pool, off[j + p] + kv + e, off[j + p + 4] + kv + e, kind);
        for (int i = 0; i < Q; i++) {
            const __m512 q = bcast8_avx512(qs[i] + e);
            for (int p = 0; p < 4; p++)
                a[i][p] = _mm512_fmadd_ps(q, k[p], a[i][p]);
        }
    }
    for (int i = 0; i < Q; i++)
        _mm256_storeu_ps(ss[i] + j, _mm256_mul_ps(hsum8_pairs(a[i]), _mm256_set1_ps(sc)));
}

static ALWAYS_INLINE void row_scores_body(const float *const *qs, const int Q, const void *pool, const int64_t *off,
                                          int64_t kv, int d, const int kind, float sc, float *const *ss, int n8,
                                          struct prefetch *pf) {
    for (int j = 0; j < n8; j += 8) {
        prefetch_step(pf);  /* twice an eight, as the ymm loops */
        prefetch_step(pf);
        pool_scores8_avx512(qs, Q, pool, off, kv, d, kind, sc, ss, j);
    }
}

/* The one-row path's scores of Q query vectors (Q <= 3, one KV head) against a chunk's first n8 keys
 * (whole eights) on zmm registers: the same bits as chunk_scores' ymm loops. */
static __attribute__((noinline)) void row_scores_avx512(const float *const *qs, int Q, const void *pool,
                                                        const int64_t *off, int64_t kv, int d, int kind, float sc,
                                                        float *const *ss, int n8, struct prefetch *pf) {
#define ROW_SCORES(KIND)                                                                      \
    do {                                                                                      \
        if (Q == 3) row_scores_body(qs, 3, pool, off, kv, d, KIND, sc, ss, n8, pf);           \
        else if (Q == 2) row_scores_body(qs, 2, pool, off, kv, d, KIND, sc, ss, n8, pf);      \
        else row_scores_body(qs, 1, pool, off, kv, d, KIND, sc, ss, n8, pf);                  \
    } while (0)
    if (kind == KV_F16) ROW_SCORES(KV_F16);
    else if (kind == KV_I8) ROW_SCORES(KV_I8);
    else ROW_SCORES(KV_F32);
#undef ROW_SCORES
}

/* ys[i][e0 .. e0+63] += ps[i][0..n) times the chunk's values straight from the pool, keys in order,
 * for Q vectors (Q <= 3): each element's fmas as weigh_values runs them. */
static ALWAYS_INLINE void pool_values64_avx512(float *const *ys, const float *const *ps, const int Q, const void *pool,
                                               const int64_t *off, int64_t kv, int n, int e0, const int kind,
                                               struct prefetch *pf) {
    __m512 a[3][4];
    for (int i = 0; i < Q; i++)
        for (int u = 0; u < 4; u++)
            a[i][u] = _mm512_loadu_ps(ys[i] + e0 + 16 * u);
    for (int j = 0; j < n; j++) {
        if ((j & 3) == 3)
            prefetch_step(pf);  /* a step every four keys: a burst of them fills the fill buffers */
        const int64_t o = off[j] + kv + e0;
        __m512 x[4];
        for (int u = 0; u < 4; u++)
            x[u] = load16_avx512(pool, o + 16 * u, kind);
        for (int i = 0; i < Q; i++) {
            const __m512 w = _mm512_set1_ps(ps[i][j]);
            for (int u = 0; u < 4; u++)
                a[i][u] = _mm512_fmadd_ps(w, x[u], a[i][u]);
        }
    }
    for (int i = 0; i < Q; i++)
        for (int u = 0; u < 4; u++)
            _mm512_storeu_ps(ys[i] + e0 + 16 * u, a[i][u]);
}

static ALWAYS_INLINE void row_values_body(float *const *ys, const float *const *ps, const int Q, const void *pool,
                                          const int64_t *off, int64_t kv, int n, int d, const int kind,
                                          struct prefetch *pf) {
    int e0 = 0;
    for (; e0 + 64 <= d; e0 += 64)
        pool_values64_avx512(ys, ps, Q, pool, off, kv, n, e0, kind, pf);
    if (e0 == 0)
        prefetch_share(pf, n, 1);
    weigh_values_tail((float **)ys, (const float **)ps, Q, e0, pool, off, kv, n, d, kind);
}

/* The one-row path's values (weigh_values and its pair and triple) for Q vectors of one KV head on
 * zmm registers: the same bits. */
static __attribute__((noinline)) void row_values_avx512(float *const *ys, const float *const *ps, int Q,
                                                        const void *pool, const int64_t *off, int64_t kv, int n,
                                                        int d, int kind, struct prefetch *pf) {
#define ROW_VALUES(KIND)                                                                 \
    do {                                                                                 \
        if (Q == 3) row_values_body(ys, ps, 3, pool, off, kv, n, d, KIND, pf);           \
        else if (Q == 2) row_values_body(ys, ps, 2, pool, off, kv, n, d, KIND, pf);      \
        else row_values_body(ys, ps, 1, pool, off, kv, n, d, KIND, pf);                  \
    } while (0)
    if (kind == KV_F16) ROW_VALUES(KV_F16);
    else if (kind == KV_I8) ROW_VALUES(KV_I8);
    else ROW_VALUES(KV_F32);
#undef ROW_VALUES
}

#pragma GCC pop_options
