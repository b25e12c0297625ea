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

static inline float hsum_ps(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

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

#define MR 8 /* rows of x per pass over a weight row: a row's unpacked weights serve MR dots */
#define ROW_BLOCK_BYTES (96 * 1024) /* x levels per block of rows: they stay in L2 while weights pass */

typedef struct {
    int64_t M, K, G, N;
    const void *qs;
    const uint16_t *d, *m;
    const int8_t *xq;
    const float *xd, *xs;
    float *y;
} gemm_args;

/* y[r0 .. r0+mr, n] for q4 weight row n. */
static inline void q4_tile(const gemm_args *a, int64_t n, int64_t r0, int mr) {
    const int64_t K = a->K, G = a->G;
    const uint8_t *wq = (const uint8_t *)a->qs + n * (K / 2);
    const uint16_t *wd = a->d + n * G, *wm = a->m + n * G;
    __m256 acc[MR];
    float macc[MR];
    for (int i = 0; i < MR; i++) {
        acc[i] = _mm256_setzero_ps();
        macc[i] = 0.0f;
    }
    for (int64_t g = 0; g < G; g++) {
        __m256i w = unpack_q4(wq + g * 16);
        float dg = _cvtsh_ss(wd[g]), mg = _cvtsh_ss(wm[g]);
        for (int i = 0; i < mr; i++) {
            int64_t r = r0 + i;
            __m256i xv = _mm256_loadu_si256((const __m256i *)(a->xq + r * K + g * QK));
            __m256 p = _mm256_cvtepi32_ps(dot_u8_s8(w, xv));
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(dg * a->xd[r * G + g]), p, acc[i]);
            macc[i] += mg * a->xs[r * G + g];
        }
    }
    for (int i = 0; i < mr; i++) a->y[(r0 + i) * a->N + n] = hsum_ps(acc[i]) + macc[i];
}

/* y[r0 .. r0+mr, n] for q8 weight row n. */
static inline void q8_tile(const gemm_args *a, int64_t n, int64_t r0, int mr) {
    const int64_t K = a->K, G = a->G;
    const int8_t *wq = (const int8_t *)a->qs + n * K;
    const uint16_t *wd = a->d + n * G;
    __m256 acc[MR];
    for (int i = 0; i < MR; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256i w = _mm256_loadu_si256((const __m256i *)(wq + g * QK));
        float dg = _cvtsh_ss(wd[g]);
        for (int i = 0; i < mr; i++) {
            int64_t r = r0 + i;
            __m256i xv = _mm256_loadu_si256((const __m256i *)(a->xq + r * K + g * QK));
            __m256 p = _mm256_cvtepi32_ps(dot_s8_s8(w, xv));
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(dg * a->xd[r * G + g]), p, acc[i]);
        }
    }
    for (int i = 0; i < mr; i++) a->y[(r0 + i) * a->N + n] = hsum_ps(acc[i]);
}

/* Quantize x, then every tile. Each thread owns a contiguous share of the weight rows; x is
 * walked in blocks of rows whose levels fit in L2, and the thread's weight rows pass over each
 * block (a prefill chunk's levels would otherwise stream from L3 once per weight row). The tiling
 * never changes the order in which an output's terms are summed. */
static inline void run_gemm(gemm_args *a, const float *x, int8_t *xq, float *xd, float *xs, int nthreads,
                            void (*tile)(const gemm_args *, int64_t, int64_t, int)) {
    int64_t block = ROW_BLOCK_BYTES / a->K / MR * MR;
    if (block < MR) block = MR;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < a->M; r++)
            for (int64_t g = 0; g < a->G; g++)
                quantize_group(x + r * a->K + g * QK, xq + r * a->K + g * QK, xd + r * a->G + g, xs + r * a->G + g);
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t n0 = a->N * t / nt, n1 = a->N * (t + 1) / nt;
        for (int64_t b = 0; b < a->M; b += block)
            for (int64_t n = n0; n < n1; n++)
                for (int64_t r0 = b; r0 < b + block && r0 < a->M; r0 += MR)
                    tile(a, n, r0, (int)(a->M - r0 < MR ? a->M - r0 : MR));
    }
}

/* xq [M, K], xd and xs [M, K / 32]: the caller's scratch for the quantized activations. */
void q4_gemm(const float *x, int64_t M, int64_t K, const uint8_t *qs, const uint16_t *d, const uint16_t *m,
             int64_t N, float *y, int8_t *xq, float *xd, float *xs, int nthreads) {
    gemm_args a = {M, K, K / QK, N, qs, d, m, xq, xd, xs, y};
    run_gemm(&a, x, xq, xd, xs, nthreads, q4_tile);
}

void q8_gemm(const float *x, int64_t M, int64_t K, const int8_t *qs, const uint16_t *d, int64_t N, float *y,
             int8_t *xq, float *xd, float *xs, int nthreads) {
    gemm_args a = {M, K, K / QK, N, qs, d, NULL, xq, xd, xs, y};
    run_gemm(&a, x, xq, xd, xs, nthreads, q8_tile);
}
