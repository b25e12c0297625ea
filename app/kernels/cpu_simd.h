/* AVX2 helpers the CPU C kernels share (included by cpu_*.c; cpu_build.py hashes this file with
 * each source, so a change here rebuilds them). */
#ifndef LOCALBATCH_CPU_SIMD_H
#define LOCALBATCH_CPU_SIMD_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* The sum of v's eight lanes. */
static inline float hsum_ps(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* exp_ps's constants, which exp16 (cpu_attention_avx512.h) shares lane for lane: the same bits. */
#define EXP_LO -87.3f
#define EXP_HI 88.3f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
static const float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                  4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

/* e^x, about 1 ulp: Cephes' expf, the exponent split as n * ln2 + r with ln2 in two parts and a
 * degree-5 polynomial for e^r, 2^n built in the exponent bits. Lanes below -87.3 give 0, lanes
 * above 88.3 give e^88.3 (2^n must fit the exponent bits; a sigmoid then comes out below 1e-38
 * instead of 0). */
static inline __m256 exp_ps(__m256 x) {
    const __m256 lo = _mm256_set1_ps(EXP_LO);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(EXP_HI));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < 6; i++)
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_POLY[i]));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* 1 / sqrt(mean(x^2) + eps) over `dim` floats (a multiple of 8): every RMS norm's scale, summed in
 * one order wherever it is computed. */
static inline float rms_inv(const float *x, int64_t dim, float eps) {
    __m256 ss = _mm256_setzero_ps();
    for (int64_t i = 0; i < dim; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        ss = _mm256_fmadd_ps(v, v, ss);
    }
    return 1.0f / sqrtf(hsum_ps(ss) / (float)dim + eps);
}

#endif
