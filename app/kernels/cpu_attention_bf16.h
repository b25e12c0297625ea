/* The tiles' dot products in bf16, for CPUs with AVX512_BF16 (vdpbf16ps), included by cpu_attention.c
 * (only paged_attention's `bf16` choice runs them; never AMX). Queries and keys are rounded to bf16
 * (nearest even) for Q.K, the softmax's weights and the values for P.V; every product is exact in
 * fp32 and summed in fp32. The softmax itself (max, exp, sums, rescaling) is the fp32 path's.
 *
 * Each score and each output element is one lane's sum in one fixed order whatever vectors or keys
 * share the registers with it (a score: its key's lane, element pairs in order; an output element:
 * key pairs in order; in each pair the odd one first, as vdpbf16ps adds them), so a row computed in
 * a tile, alone, or split by heads gives the same bits. reference_bf16.py is the torch statement of
 * this arithmetic (up to those orders). */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512bf16")

/* A thread's bf16 scratch: a tile's queries turned (dp / 2 rows of up to MAX_TILE_VECS dwords), a
 * chunk's keys (KEY_CHUNK rows of dp bf16, then turned: dp / 2 rows of KEY_CHUNK dwords) and value
 * pairs (KEY_CHUNK / 2 pairs of dv). dp: d rounded up to 32; dv: to 16. */
struct bf16_scratch {
    uint32_t *q, *kt;
    uint16_t *k, *v;
};

static inline int round_up(int x, int m) {
    return (x + m - 1) / m * m;
}

/* The lanes of elements e..e+15 that lie below d. */
static inline __mmask16 lanes16(int e, int d) {
    return e + 16 <= d ? (__mmask16)0xFFFF : e < d ? (__mmask16)((1u << (d - e)) - 1) : (__mmask16)0;
}

/* Sixteen pool elements from element i + e on, those below d (0 past it), as fp32 (exact): the pool
 * holds `kind` (KV_F32 ..). */
static inline __m512 pool16(const void *pool, int64_t i, int e, int d, int kind) {
    const __mmask16 m = lanes16(e, d);
    if (kind == KV_F16)
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)pool + i + e));
    if (kind == KV_I8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, (const int8_t *)pool + i + e)));
    return _mm512_maskz_loadu_ps(m, (const float *)pool + i + e);
}

/* A row of d elements rounded to bf16 (nearest even) into dp at dst, zeros past d: fp32 values at x
 * (kind KV_F32, i 0), or a pool row from element i. */
static inline void bf16_row(uint16_t *dst, const void *x, int64_t i, int d, int dp, int kind) {
    for (int e = 0; e < dp; e += 32)
        _mm512_storeu_si512(dst + e, (__m512i)_mm512_cvtne2ps_pbh(pool16(x, i, e + 16, d, kind), pool16(x, i, e, d, kind)));
}

/* Keys 0..n-1's values (pool rows at off[j] + kv) as pairs: pair i's elements e..e+15 are one 64-byte
 * line, v[2i][e], v[2i+1][e], v[2i][e+1], ...; a missing odd key and elements past d are 0. */
static inline void bf16_pairs(uint16_t *dst, const void *pool, const int64_t *off, int64_t kv, int n, int d, int dv,
                              int kind) {
    static const uint16_t interleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                            8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i idx = _mm512_loadu_si512(interleave);
    for (int i = 0; 2 * i < n; i++)
        for (int e = 0; e < dv; e += 16) {
            __m512 a = pool16(pool, off[2 * i] + kv, e, d, kind);
            __m512 b = 2 * i + 1 < n ? pool16(pool, off[2 * i + 1] + kv, e, d, kind) : _mm512_setzero_ps();
            __m512i w = (__m512i)_mm512_cvtne2ps_pbh(b, a);
            _mm512_storeu_si512(dst + ((int64_t)i * dv + e) * 2, _mm512_permutexvar_epi16(idx, w));
        }
}

/* r[0..16) as a 16 x 16 matrix of dwords, transposed in place. */
static inline void transpose16(__m512i *r) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2)
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]), r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]), r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; j++)
            t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88),
            t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
    for (int j = 0; j < 8; j++)
        r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88), r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
}

/* The chunk's keys (bf16 rows of dp at kb, as dwords: element pairs) turned so that each element pair
 * i is a row of the keys' dwords, kt[i * KEY_CHUNK + j]: a score's 16 lanes are then 16 keys, summed
 * over the pairs with no horizontal sum. Keys n.. (to the 16 the halves take) are 0. */
static inline void transpose_keys(uint32_t *kt, const uint16_t *kb, int n, int dp) {
    const int pairs = dp / 2;
    for (int h = 0; h * 16 < n; h++)
        for (int c = 0; c < pairs; c += 16) {
            __m512i r[16];
            for (int l = 0; l < 16; l++)
                r[l] = h * 16 + l < n ? _mm512_loadu_si512(kb + (int64_t)(h * 16 + l) * dp + 2 * c) : _mm512_setzero_si512();
            transpose16(r);
            for (int l = 0; l < 16; l++)
                _mm512_storeu_si512(kt + (int64_t)(c + l) * KEY_CHUNK + h * 16, r[l]);
        }
}

/* Scores (times sc) of NV query vectors (turned bf16 queries: vector v's element pair i at
 * qt[i * stride + v]) against the chunk's keys 0 .. 16 * H - 1 (turned, kt): key j's score is lane
 * j % 16 of half j / 16, its element pairs added in order (each pair's odd element first, as
 * vdpbf16ps adds them), the same whatever shares the registers. */
static ALWAYS_INLINE void scores_bf16(const uint32_t *qt, int stride, const int NV, const uint32_t *kt, int pairs,
                                      const int H, float sc, float *const *ss) {
    __m512 a[12][2];
    for (int v = 0; v < NV; v++)
        for (int h = 0; h < H; h++)
            a[v][h] = _mm512_setzero_ps();
    for (int i = 0; i < pairs; i++) {
        __m512bh k[2];
        for (int h = 0; h < H; h++)
            k[h] = (__m512bh)_mm512_loadu_si512(kt + (int64_t)i * KEY_CHUNK + 16 * h);
        for (int v = 0; v < NV; v++) {
            __m512bh x = (__m512bh)_mm512_set1_epi32((int)qt[(int64_t)i * stride + v]);
            for (int h = 0; h < H; h++)
                a[v][h] = _mm512_dpbf16_ps(a[v][h], k[h], x);
        }
    }
    for (int v = 0; v < NV; v++)
        for (int h = 0; h < H; h++)
            _mm512_storeu_ps(ss[v] + 16 * h, _mm512_mul_ps(a[v][h], _mm512_set1_ps(sc)));
}

/* scores_bf16 over H halves for vectors 0..nv-1, in blocks of NB (then the rest one at a time). */
static ALWAYS_INLINE void scores_bf16_halves(const uint32_t *qt, int stride, float *const *ss, int nv,
                                             const uint32_t *kt, int pairs, const int H, const int NB, float sc) {
    int v = 0;
    for (; v + NB <= nv; v += NB)
        scores_bf16(qt + v, stride, NB, kt, pairs, H, sc, ss + v);
    for (; v < nv; v++)
        scores_bf16(qt + v, stride, 1, kt, pairs, H, sc, ss + v);
}

/* Scores of vectors 0..nv-1 against keys 0..n-1 (and to the next 16: kt holds them as 0). */
static ALWAYS_INLINE void tile_scores_bf16(const uint32_t *qt, int stride, float *const *ss, int nv,
                                           const uint32_t *kt, int n, int dp, float sc) {
    if (n > 16)
        scores_bf16_halves(qt, stride, ss, nv, kt, dp / 2, 2, 8, sc);
    else
        scores_bf16_halves(qt, stride, ss, nv, kt, dp / 2, 1, 12, sc);
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
static ALWAYS_INLINE void tile_chunk_bf16_kind(const uint32_t *qt, float *const *ys, float *const *ss, float *m,
                                               float *l, const int64_t *lasts, int nr, int per, int64_t c0, int n,
                                               const float *ksc, const float *vsc, const kv_pools *kv,
                                               const int64_t *off, int64_t kvo, int kind, int d, float scale,
                                               float softcap, const struct bf16_scratch *b) {
    int r_c;
    const int r_f = tile_rows_seeing(lasts, nr, c0, n, &r_c);
    const int dp = round_up(d, 32), dv = round_up(d, 16);
    const float sc = kind == KV_I8 ? 1.0f : scale;  /* as chunk_scores */
    for (int j = 0; j < n; j++)
        bf16_row(b->k + (int64_t)j * dp, kv->k, off[j] + kvo, d, dp, kind);
    transpose_keys(b->kt, b->k, n, dp);
    /* every vector over all n keys: a diagonal row's later lanes are dropped (tile_softmax) */
    tile_scores_bf16(qt + r_c * per, nr * per, ss + r_c * per, (nr - r_c) * per, b->kt, n, dp, sc);
    tile_softmax(ys, ss, m, l, lasts, nr, per, r_c, r_f, c0, n, ksc, vsc, kind, d, scale, softcap, 1);
    bf16_pairs(b->v, kv->v, off, kvo, n, d, dv, kind);
    for (int r = r_c; r < r_f; r++)
        tile_values_bf16(ys + r * per, ss + r * per, per, b->v, keys_seen(lasts, r, r_f, c0, n), d, dv);
    tile_values_bf16(ys + r_f * per, ss + r_f * per, (nr - r_f) * per, b->v, n, d, dv);
}

/* tile_chunk_bf16_kind with the pool's kind a constant in the loops. */
static __attribute__((noinline)) void tile_chunk_bf16(const uint32_t *qt, float *const *ys, float *const *ss,
                                                      float *m, float *l, const int64_t *lasts, int nr, int per,
                                                      int64_t c0, int n, const float *ksc, const float *vsc,
                                                      const kv_pools *kv, const int64_t *off, int64_t kvo, int kind,
                                                      int d, float scale, float softcap,
                                                      const struct bf16_scratch *b) {
    if (kind == KV_F16)
        tile_chunk_bf16_kind(qt, ys, ss, m, l, lasts, nr, per, c0, n, ksc, vsc, kv, off, kvo, KV_F16, d, scale,
                             softcap, b);
    else if (kind == KV_I8)
        tile_chunk_bf16_kind(qt, ys, ss, m, l, lasts, nr, per, c0, n, ksc, vsc, kv, off, kvo, KV_I8, d, scale,
                             softcap, b);
    else
        tile_chunk_bf16_kind(qt, ys, ss, m, l, lasts, nr, per, c0, n, ksc, vsc, kv, off, kvo, KV_F32, d, scale,
                             softcap, b);
}

/* The tile's nv query vectors rounded to bf16 and turned: vector v's element pair i at
 * b->q[i * nv + v] (one pointer then serves a block of vectors' broadcasts). */
static __attribute__((noinline)) void bf16_queries(const float *const *qs, int nv, int d,
                                                   const struct bf16_scratch *b) {
    const int dp = round_up(d, 32);
    uint32_t *qt = b->q, *row = (uint32_t *)b->k;  /* the keys' rows: free until the first chunk */
    for (int v = 0; v < nv; v++) {
        bf16_row((uint16_t *)row, qs[v], 0, d, dp, KV_F32);
        for (int i = 0; i < dp / 2; i++)
            qt[(int64_t)i * nv + v] = row[i];
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
