/* Weight-quantized GEMM for x86 CPUs with AVX2, FMA and F16C (llama.cpp's way of multiplying on
 * the CPU): a decode step reads 5 (q4) or 8.5 (q8) bits a weight.
 *
 * y[M, N] = x[M, K] @ W[N, K]^T with W stored in groups of 32 along K:
 *   q4: w = d * level + m, level 0..15 (two per byte: byte j of a group holds level j in its low
 *       nibble and level j + 16 in its high one), d and m fp16 per group (a Q4_1 block's layout);
 *   q8: w = d * level, level -127..127 (int8), d fp16 per group.
 * Each row of x is quantized per group of 32 to int8 (scale absmax / 127, round to nearest even),
 * as llama.cpp's Q8 activations are; a group's dot product is then exact integer arithmetic
 * (maddubs / madd), scaled once. Every output is computed from its own row in the same order
 * whatever M is: batch-invariant by construction, so every batch size, prefill chunks included,
 * goes through these loops.
 *
 * Built at first use by app/kernels/cpu_qgemm.py with -fopenmp: its runtime is the libgomp that
 * torch has already loaded, so its threads are torch's.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#define QK 32

static inline int hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

static inline float hmax_ps(__m256 v) {
    __m128 lo = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_max_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* One group of 32 floats -> 32 int8 (round to nearest even), its scale, and scale * the sum of
 * its levels. */
static inline void quantize_group(const float *x, int8_t *q, float *scale, float *sum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    float a = hmax_ps(amax);
    float d = a / 127.0f;
    *scale = d;
    __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
    __m256i i32[4];
    for (int i = 0; i < 4; i++) {
        __m256 t = _mm256_mul_ps(v[i], inv);
        t = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        i32[i] = _mm256_cvtps_epi32(t);
    }
    /* pack 32 x int32 -> 32 x int8 in order */
    __m256i p01 = _mm256_packs_epi32(i32[0], i32[1]);
    __m256i p23 = _mm256_packs_epi32(i32[2], i32[3]);
    __m256i p = _mm256_packs_epi16(p01, p23);
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, p);
    /* The m term multiplies the sum of the quantized activations, as a dense GEMM over them would. */
    __m256i t = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
    *sum = d * (float)hsum_epi32(t);
}

/* 32 unsigned weights (q4 levels 0..15) . 32 signed activations, as 8 int32 partial sums. */
static inline __m256i dot_u8_s8(__m256i w_u8, __m256i x_s8) {
    __m256i p16 = _mm256_maddubs_epi16(w_u8, x_s8);
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

/* Signed . signed: maddubs wants one operand unsigned, so |x| times the weights with x's signs. */
static inline __m256i dot_s8_s8(__m256i w_s8, __m256i x_s8) {
    __m256i ax = _mm256_sign_epi8(x_s8, x_s8);
    __m256i sw = _mm256_sign_epi8(w_s8, x_s8);
    __m256i p16 = _mm256_maddubs_epi16(ax, sw);
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

static inline __m256i unpack_q4(const uint8_t *qs) {
    __m128i b = _mm_loadu_si128((const __m128i *)qs);
    __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
    return _mm256_set_m128i(hi, lo);
}

#define TILE 8 /* outputs per tile: one per lane of an 8 x fp32 vector */
#define ROW_BLOCK_BYTES (96 * 1024) /* x levels per block of rows: they stay in L2 while weights pass */

/* Lane i of the result: the sum of s[i]'s eight lanes. */
static inline __m256i reduce8_epi32(const __m256i *s) {
    __m256i t0 = _mm256_hadd_epi32(s[0], s[1]), t1 = _mm256_hadd_epi32(s[2], s[3]);
    __m256i t2 = _mm256_hadd_epi32(s[4], s[5]), t3 = _mm256_hadd_epi32(s[6], s[7]);
    __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
    return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

/* Scales come in tiles of 8 rows: element (row, group) of a [rows, G] table sits at
 * [row / 8][group][row % 8], so a tile's eight scales for one group are one vector load. */
static inline int64_t tiled(int64_t row, int64_t g, int64_t G) { return (row / TILE) * G * TILE + g * TILE + row % TILE; }

typedef struct {
    int64_t M, K, G, N;
    const void *qs;
    const uint16_t *d, *m; /* weight scales (and q4 minimums), tiled */
    const int8_t *xq;
    const float *xd, *xs; /* activation scales and scaled level sums, tiled */
    float *y;
} gemm_args;

/* Every output y[r, n] is, over the groups g in order,
 *     acc = fma(d[n, g] * xd[r, g], (float)dot_int(w[n, g], x[r, g]), acc)
 *     mac = fma(m[n, g], xs[r, g], mac)            (q4 only)
 * and then acc + mac, in one lane of a tile. The two tile shapes below (eight weight rows against
 * one activation row, one weight row against eight activation rows) compute exactly that, so
 * neither the batch size nor the tiling changes a bit of any output. */

static inline __m256i q4_dot(__m256i w, __m256i x) { return dot_u8_s8(w, x); }
static inline __m256i q8_dot(__m256i w, __m256i x) { return dot_s8_s8(w, x); }

static inline __m256i q4_load(const gemm_args *a, int64_t n, int64_t g) {
    return unpack_q4((const uint8_t *)a->qs + n * (a->K / 2) + g * 16);
}

static inline __m256i q8_load(const gemm_args *a, int64_t n, int64_t g) {
    return _mm256_loadu_si256((const __m256i *)((const int8_t *)a->qs + n * a->K + g * QK));
}

/* Weight rows n .. n+7 (those below N) against activation row r. */
static inline void tile_n8(const gemm_args *a, int64_t n, int64_t r, int q4) {
    const int64_t G = a->G, K = a->K;
    int64_t rows[TILE];
    for (int j = 0; j < TILE; j++) rows[j] = n + j < a->N ? n + j : a->N - 1;
    __m256 acc = _mm256_setzero_ps(), mac = _mm256_setzero_ps();
    const uint16_t *dt = a->d + (n / TILE) * G * TILE, *mt = q4 ? a->m + (n / TILE) * G * TILE : NULL;
    for (int64_t g = 0; g < G; g++) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(a->xq + r * K + g * QK));
        __m256i s[TILE];
        for (int j = 0; j < TILE; j++)
            s[j] = q4 ? q4_dot(q4_load(a, rows[j], g), x) : q8_dot(q8_load(a, rows[j], g), x);
        __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dt + g * TILE)));
        __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(a->xd[tiled(r, g, G)]));
        acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(reduce8_epi32(s)), acc);
        if (q4) {
            __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mt + g * TILE)));
            mac = _mm256_fmadd_ps(mw, _mm256_set1_ps(a->xs[tiled(r, g, G)]), mac);
        }
    }
    float out[TILE];
    _mm256_storeu_ps(out, q4 ? _mm256_add_ps(acc, mac) : acc);
    for (int j = 0; j < TILE && n + j < a->N; j++) a->y[r * a->N + n + j] = out[j];
}

/* Weight row n against activation rows r .. r+7 (r a multiple of 8, all below M). */
static inline void tile_r8(const gemm_args *a, int64_t n, int64_t r, int q4) {
    const int64_t G = a->G, K = a->K;
    __m256 acc = _mm256_setzero_ps(), mac = _mm256_setzero_ps();
    const float *xdt = a->xd + (r / TILE) * G * TILE, *xst = a->xs + (r / TILE) * G * TILE;
    for (int64_t g = 0; g < G; g++) {
        __m256i w = q4 ? q4_load(a, n, g) : q8_load(a, n, g);
        __m256i s[TILE];
        for (int i = 0; i < TILE; i++) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(a->xq + (r + i) * K + g * QK));
            s[i] = q4 ? q4_dot(w, x) : q8_dot(w, x);
        }
        __m256 scale = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(a->d[tiled(n, g, G)])), _mm256_loadu_ps(xdt + g * TILE));
        acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(reduce8_epi32(s)), acc);
        if (q4)
            mac = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(a->m[tiled(n, g, G)])), _mm256_loadu_ps(xst + g * TILE), mac);
    }
    float out[TILE];
    _mm256_storeu_ps(out, q4 ? _mm256_add_ps(acc, mac) : acc);
    for (int i = 0; i < TILE; i++) a->y[(r + i) * a->N + n] = out[i];
}

/* Quantize x, then every tile. Each thread owns a contiguous share of the weight rows (whole
 * tiles of 8); x is walked in blocks of rows whose levels fit in L2 while the thread's weight rows
 * pass over each block, and the rows past the last multiple of 8 take the eight-weight-row tiles
 * (all of a decode step's rows, when there are fewer than 8). */
static inline void run_gemm(gemm_args *a, const float *x, int8_t *xq, float *xd, float *xs, int nthreads, int q4) {
    const int64_t M = a->M, K = a->K, G = a->G, full = M / TILE * TILE;
    int64_t block = ROW_BLOCK_BYTES / K / TILE * TILE;
    if (block < TILE) block = TILE;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++)
            for (int64_t g = 0; g < G; g++)
                quantize_group(x + r * K + g * QK, xq + r * K + g * QK, xd + tiled(r, g, G), xs + tiled(r, g, G));
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t tiles = (a->N + TILE - 1) / TILE;
        int64_t n0 = tiles * t / nt * TILE, n1 = tiles * (t + 1) / nt * TILE;
        if (n1 > a->N) n1 = a->N;
        for (int64_t b = 0; b < full; b += block)
            for (int64_t n = n0; n < n1; n++)
                for (int64_t r = b; r < b + block && r < full; r += TILE)
                    tile_r8(a, n, r, q4);
        for (int64_t n = n0; n < n1; n += TILE)  /* a weight tile stays in L1 for the rows that follow */
            for (int64_t r = full; r < M; r++)
                tile_n8(a, n, r, q4);
    }
}

/* x [M, K] fp32; weights as Q4Weight / Q8Weight (cpu_qgemm.py) lay them out; xq [M, K] int8 and
 * xd, xs [ceil(M / 8) * 8 * K / 32] fp32: the caller's scratch for the quantized activations. */
void q4_gemm(const float *x, int64_t M, int64_t K, const uint8_t *qs, const uint16_t *d, const uint16_t *m,
             int64_t N, float *y, int8_t *xq, float *xd, float *xs, int nthreads) {
    gemm_args a = {M, K, K / QK, N, qs, d, m, xq, xd, xs, y};
    run_gemm(&a, x, xq, xd, xs, nthreads, 1);
}

void q8_gemm(const float *x, int64_t M, int64_t K, const int8_t *qs, const uint16_t *d, int64_t N, float *y,
             int8_t *xq, float *xd, float *xs, int nthreads) {
    gemm_args a = {M, K, K / QK, N, qs, d, NULL, xq, xd, xs, y};
    run_gemm(&a, x, xq, xd, xs, nthreads, 0);
}
