/* The fp32 tiles' dot products and value sums on zmm registers, for CPUs whose GEMM tiles run with
 * AVX-512 (qgemm_isa), included by cpu_attention.c. Twice the lanes an instruction of the ymm loops
 * (tile_scores, tile_values), and the same bits: each lane runs the same fma sequence as a lane of
 * those loops, and each score's eight lanes are summed in hsum4_ps's tree ((0+1)+(2+3)) + ((4+5)+(6+7)).
 *
 * A score's lanes: the chunk's keys are widened a second time into pairs (widen_pairs): of each group
 * of 8 keys, pair p holds keys p and p+4, element block e (8 floats) of one beside the other's, so a
 * zmm load gives two keys' blocks and a broadcast query block meets both. */

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

#pragma GCC pop_options
