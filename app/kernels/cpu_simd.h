/* AVX2 helpers the CPU C kernels share (included by cpu_*.c; cpu_build.py hashes this file with
 * each source, so a change here rebuilds them). */
#ifndef LOCALBATCH_CPU_SIMD_H
#define LOCALBATCH_CPU_SIMD_H

#include <immintrin.h>

/* The sum of v's eight lanes. */
static inline float hsum_ps(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

#endif
