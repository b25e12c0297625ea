/* Row-wise ops of the fp32 CPU path in C (x86 with AVX2 and FMA). A decode step of a small model
 * makes ~60 RMS norms of a few hundred floats each; through torch each is a chain of small ops
 * (~45 us), here one call (~5 us). Every row is computed alone, in one order: batch-invariant.
 */
#include "cpu_simd.h"
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, for rows of `dim` floats (a multiple of 8); `w`
 * holds one row of weights, or one per row of x when `w_rows` (per-head norms). With `residual`,
 * the norm is of x[r] + residual[r], which goes to total[r]: the layer's skip connection and the
 * next norm in one pass. */
void rms_norm_f32(const float *x, const float *residual, float *total, const float *w, float *out, int64_t rows,
                  int64_t dim, int64_t w_rows, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = residual ? total + r * dim : x + r * dim;
        const float *wr = w + (w_rows > 1 ? (r % w_rows) * dim : 0);
        __m256 ss = _mm256_setzero_ps();
        for (int64_t i = 0; i < dim; i += 8) {
            __m256 v = _mm256_loadu_ps(x + r * dim + i);
            if (residual) {
                v = _mm256_add_ps(v, _mm256_loadu_ps(residual + r * dim + i));
                _mm256_storeu_ps(total + r * dim + i, v);
            }
            ss = _mm256_fmadd_ps(v, v, ss);
        }
        __m256 scale = _mm256_set1_ps(1.0f / sqrtf(hsum_ps(ss) / (float)dim + eps));
        for (int64_t i = 0; i < dim; i += 8)
            _mm256_storeu_ps(out + r * dim + i,
                             _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), scale), _mm256_loadu_ps(wr + i)));
    }
}
