/* Row-wise ops of the fp32 CPU path in C (x86 with AVX2 and FMA). A decode step of a small model
 * makes ~60 RMS norms of a few hundred floats each; through torch each is a chain of small ops,
 * here one call; the MLP's gated activation and the sampler's argmax likewise.
 * Every row is computed alone, in one order: batch-invariant.
 */
#include "cpu_kernels.h"
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
        const float *xr = x + r * dim;
        if (residual) {
            for (int64_t i = 0; i < dim; i += 8)
                _mm256_storeu_ps(total + r * dim + i,
                                 _mm256_add_ps(_mm256_loadu_ps(xr + i), _mm256_loadu_ps(residual + r * dim + i)));
            xr = total + r * dim;
        }
        const float *wr = w + (w_rows > 1 ? (r % w_rows) * dim : 0);
        __m256 scale = _mm256_set1_ps(rms_inv(xr, dim, eps));
        for (int64_t i = 0; i < dim; i += 8)
            _mm256_storeu_ps(out + r * dim + i,
                             _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), scale), _mm256_loadu_ps(wr + i)));
    }
}

/* The gated MLP's activation: out[r, i] = act(gate) * up for gate = x[r, i], up = x[r, f + i]
 * (rows of 2f floats, f a multiple of 8). act 0: SiLU, gate * sigmoid(gate); 1: GELU's tanh form,
 * written as gate * sigmoid(2u) with u = sqrt(2 / pi) * (gate + 0.044715 gate^3) (the same
 * function: 0.5 (1 + tanh u) = sigmoid(2u), without tanh's cancellation for negative u). */
/* A prompt chunk's rows (512 x 8,960 on the 1.5B) are split over `threads`; a decode step's few
 * rows are not worth a team's start. */
#define GLU_PARALLEL_MIN (1 << 16)

void glu_f32(const float *x, float *out, int64_t rows, int64_t f, int act, int threads) {
    const __m256 one = _mm256_set1_ps(1.0f);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows > 1 && rows * f >= GLU_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < f; i += 8) {
            __m256 g = _mm256_loadu_ps(x + r * 2 * f + i), z = g;
            if (act == 1) {
                __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
                __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                         _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(0.044715f), g3)));
                z = _mm256_add_ps(u, u);
            }
            __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), z))));
            _mm256_storeu_ps(out + r * f + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(x + r * 2 * f + f + i)));
        }
}

/* out[r] = the index of the first largest value in row r of x [rows, n] (a NaN counts as the
 * largest, the first NaN winning, as torch.argmax has it). The sampler's greedy pick, in one pass at
 * memory speed. */
void argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * n;
        __m256 mx = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            __m256 v = _mm256_loadu_ps(row + i);
            mx = _mm256_max_ps(v, mx);  /* a NaN in v gives mx back: NaNs are looked for apart */
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        float best = -INFINITY, lanes[8];
        _mm256_storeu_ps(lanes, mx);
        for (int k = 0; k < 8; k++) best = lanes[k] > best ? lanes[k] : best;
        int has_nan = _mm256_movemask_ps(nan) != 0;
        for (; i < n; i++) {
            has_nan |= row[i] != row[i];
            best = row[i] > best ? row[i] : best;
        }
        int64_t found = 0;  /* every value -inf: index 0, as torch */
        for (int64_t j = 0; j < n; j++)
            if (has_nan ? row[j] != row[j] : row[j] == best) {
                found = j;
                break;
            }
        out[r] = found;
    }
}
