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
 * whatever M is: batch-invariant by construction. `*_dequantize` writes the fp32 weights, for
 * prefill-sized batches that multiply the same quantized activations with a dense GEMM.
 *
 * Built at first use by app/kernels/cpu_qgemm.py with -fopenmp: its runtime is the libgomp that
 * torch has already loaded, so its threads are torch's.
 */
#include <immintrin.h>
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

/* x [M, K] fp32 -> xq [M, K] int8, xd [M, K/32] scales, xs [M, K/32] scaled sums of the levels. */
static void quantize_rows(const float *x, int64_t M, int64_t K, int8_t *xq, float *xd, float *xs) {
    int64_t G = K / QK;
    for (int64_t r = 0; r < M; r++)
        for (int64_t g = 0; g < G; g++)
            quantize_group(x + r * K + g * QK, xq + r * K + g * QK, xd + r * G + g, xs + r * G + g);
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

/* xq [M, K], xd and xs [M, K / 32]: the caller's scratch for the quantized activations. */
void q4_gemm(const float *x, int64_t M, int64_t K, const uint8_t *qs, const uint16_t *d, const uint16_t *m,
             int64_t N, float *y, int8_t *xq, float *xd, float *xs, int nthreads) {
    const int64_t G = K / QK;
    quantize_rows(x, M, K, xq, xd, xs);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wq = qs + n * (K / 2);
        const uint16_t *wd = d + n * G, *wm = m + n * G;
        for (int64_t r0 = 0; r0 < M; r0 += MR) {
            int mr = (int)(M - r0 < MR ? M - r0 : MR);
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
                    __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * K + g * QK));
                    __m256 p = _mm256_cvtepi32_ps(dot_u8_s8(w, xv));
                    acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(dg * xd[r * G + g]), p, acc[i]);
                    macc[i] += mg * xs[r * G + g];
                }
            }
            for (int i = 0; i < mr; i++) y[(r0 + i) * N + n] = hsum_ps(acc[i]) + macc[i];
        }
    }
}

void q8_gemm(const float *x, int64_t M, int64_t K, const int8_t *qs, const uint16_t *d, int64_t N, float *y,
             int8_t *xq, float *xd, float *xs, int nthreads) {
    const int64_t G = K / QK;
    quantize_rows(x, M, K, xq, xd, xs);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *wq = qs + n * K;
        const uint16_t *wd = d + n * G;
        for (int64_t r0 = 0; r0 < M; r0 += MR) {
            int mr = (int)(M - r0 < MR ? M - r0 : MR);
            __m256 acc[MR];
            for (int i = 0; i < MR; i++) acc[i] = _mm256_setzero_ps();
            for (int64_t g = 0; g < G; g++) {
                __m256i w = _mm256_loadu_si256((const __m256i *)(wq + g * QK));
                float dg = _cvtsh_ss(wd[g]);
                for (int i = 0; i < mr; i++) {
                    int64_t r = r0 + i;
                    __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * K + g * QK));
                    __m256 p = _mm256_cvtepi32_ps(dot_s8_s8(w, xv));
                    acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(dg * xd[r * G + g]), p, acc[i]);
                }
            }
            for (int i = 0; i < mr; i++) y[(r0 + i) * N + n] = hsum_ps(acc[i]);
        }
    }
}

static inline __m256 u8_to_ps(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }
static inline __m256 i8_to_ps(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }

/* The 32 weights of one q4 group as 4 x 8 floats, in order. */
static inline void q4_group(const uint8_t *qs, uint16_t d16, uint16_t m16, __m256 w[4]) {
    __m256i levels = unpack_q4(qs);
    __m128i lo = _mm256_castsi256_si128(levels), hi = _mm256_extracti128_si256(levels, 1);
    __m256 d = _mm256_set1_ps(_cvtsh_ss(d16)), m = _mm256_set1_ps(_cvtsh_ss(m16));
    w[0] = _mm256_fmadd_ps(u8_to_ps(lo), d, m);
    w[1] = _mm256_fmadd_ps(u8_to_ps(_mm_srli_si128(lo, 8)), d, m);
    w[2] = _mm256_fmadd_ps(u8_to_ps(hi), d, m);
    w[3] = _mm256_fmadd_ps(u8_to_ps(_mm_srli_si128(hi, 8)), d, m);
}

static inline void q8_group(const int8_t *qs, uint16_t d16, __m256 w[4]) {
    __m128i a = _mm_loadu_si128((const __m128i *)qs), b = _mm_loadu_si128((const __m128i *)(qs + 16));
    __m256 d = _mm256_set1_ps(_cvtsh_ss(d16));
    w[0] = _mm256_mul_ps(i8_to_ps(a), d);
    w[1] = _mm256_mul_ps(i8_to_ps(_mm_srli_si128(a, 8)), d);
    w[2] = _mm256_mul_ps(i8_to_ps(b), d);
    w[3] = _mm256_mul_ps(i8_to_ps(_mm_srli_si128(b, 8)), d);
}

/* The whole matrix dequantized into out [N, K] fp32: for prefill-sized batches, where a dense
 * GEMM over the dequantized copy beats the dot-product loop above. */
void q4_dequantize(const uint8_t *qs, const uint16_t *d, const uint16_t *m, int64_t N, int64_t K, float *out,
                   int nthreads) {
    const int64_t G = K / QK;
    _Pragma("omp parallel for num_threads(nthreads) schedule(static)")
    for (int64_t n = 0; n < N; n++)
        for (int64_t g = 0; g < G; g++) {
            __m256 w[4];
            q4_group(qs + n * (K / 2) + g * 16, d[n * G + g], m[n * G + g], w);
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + n * K + g * QK + 8 * i, w[i]);
        }
}

void q8_dequantize(const int8_t *qs, const uint16_t *d, int64_t N, int64_t K, float *out, int nthreads) {
    const int64_t G = K / QK;
    _Pragma("omp parallel for num_threads(nthreads) schedule(static)")
    for (int64_t n = 0; n < N; n++)
        for (int64_t g = 0; g < G; g++) {
            __m256 w[4];
            q8_group(qs + n * K + g * QK, d[n * G + g], w);
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + n * K + g * QK + 8 * i, w[i]);
        }
}
