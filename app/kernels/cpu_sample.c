/* The sampler's draw for fp32 CPU rows: temperature, top-k, top-p and min-p, then one uniform
 * number located in what is left. Torch's version makes a dozen passes over the vocabulary and a
 * 1024-wide top-k, a large share of a small model's decode step; here it is two passes and a sort
 * of the few tokens that can be kept.
 *
 * The order the draw walks is fixed by the row alone (batch-invariant): unfiltered rows, the whole
 * vocabulary by token id; filtered rows, the kept tokens by probability, highest first, equal ones
 * by token id. cpu_sample.py holds the torch reference of exactly this.
 */
#include "cpu_simd.h"
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    float p;
    int32_t id;
} cand;

/* Per calling thread, grown as needed: a row's probabilities and its candidates. */
static __thread float *probs;
static __thread cand *cands;
static __thread int64_t scratch_n;

static int scratch(int64_t n) {
    if (n <= scratch_n) return 0;
    free(probs);
    free(cands);
    probs = malloc((size_t)n * sizeof(float));
    cands = malloc((size_t)n * sizeof(cand));
    scratch_n = probs && cands ? n : 0;
    return scratch_n ? 0 : -1;
}

static int by_prob(const void *a, const void *b) {
    const cand *x = a, *y = b;
    if (x->p != y->p) return x->p > y->p ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* The eight lanes of a and b (four each) in lane order: every sum over a row is taken in eight
 * running lanes, then across them (cpu_sample.py's reference sums in the same order). */
static inline double hsum_pd(__m256d a, __m256d b) {
    double lanes[8];
    _mm256_storeu_pd(lanes, a);
    _mm256_storeu_pd(lanes + 4, b);
    double total = 0.0;
    for (int k = 0; k < 8; k++) total += lanes[k];
    return total;
}

static inline void add_lanes(__m256d *a, __m256d *b, __m256 v) {
    *a = _mm256_add_pd(*a, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
    *b = _mm256_add_pd(*b, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
}

/* Eight logits from x + i (past n: -inf). */
static inline __m256 load8(const float *x, int64_t i, int64_t n) {
    if (i + 8 <= n) return _mm256_loadu_ps(x + i);
    float pad[8];
    for (int k = 0; k < 8; k++) pad[k] = i + k < n ? x[i + k] : -INFINITY;
    return _mm256_loadu_ps(pad);
}

static float row_max(const float *x, int64_t n) {
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int64_t i = 0; i < n; i += 8) mx = _mm256_max_ps(load8(x, i, n), mx); /* a NaN gives mx back */
    float lanes[8], m = -INFINITY;
    _mm256_storeu_ps(lanes, mx);
    for (int k = 0; k < 8; k++) m = lanes[k] > m ? lanes[k] : m;
    return m;
}

/* exp((x - max) / t) of every logit into probs (the largest is 1); their sum. -inf (a masked
 * token) and NaN give 0; with +inf logits, those alone get 1. */
static double scaled_exp(const float *x, int64_t n, float t) {
    const float m = row_max(x, n);
    if (m == INFINITY || m == -INFINITY) {
        double total = 0.0;
        for (int64_t i = 0; i < n; i++) total += probs[i] = x[i] == INFINITY;
        return total;
    }
    const __m256 top = _mm256_set1_ps(m), inv = _mm256_set1_ps(1.0f / t);
    __m256d a = _mm256_setzero_pd(), b = _mm256_setzero_pd();
    float tail[8];
    for (int64_t i = 0; i < n; i += 8) {
        __m256 v = load8(x, i, n);
        __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q), exp_ps(_mm256_mul_ps(_mm256_sub_ps(v, top), inv)));
        add_lanes(&a, &b, e);
        if (i + 8 <= n) {
            _mm256_storeu_ps(probs + i, e);
        } else {
            _mm256_storeu_ps(tail, e);
            for (int64_t k = 0; i + k < n; k++) probs[i + k] = tail[k];
        }
    }
    return hsum_pd(a, b);
}

/* The candidates: every token whose probability is at least c (above 0 when c is 0), highest
 * first; their count. */
static int64_t gather(int64_t n, float c) {
    int64_t count = 0;
    for (int64_t i = 0; i < n; i++)
        if (probs[i] >= c && probs[i] > 0.0f) cands[count++] = (cand){probs[i], (int32_t)i};
    qsort(cands, (size_t)count, sizeof(cand), by_prob);
    return count;
}

/* How many tokens have a probability of at least c, and their mass. */
static int64_t at_least(int64_t n, float c, double *mass) {
    const __m256 vc = _mm256_set1_ps(c);
    __m256d a = _mm256_setzero_pd(), b = _mm256_setzero_pd();
    int64_t count = 0, i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(probs + i), hit = _mm256_cmp_ps(v, vc, _CMP_GE_OQ);
        count += __builtin_popcount(_mm256_movemask_ps(hit));
        add_lanes(&a, &b, _mm256_and_ps(hit, v));
    }
    *mass = hsum_pd(a, b);
    for (; i < n; i++)
        if (probs[i] >= c) count++, *mass += probs[i];
    return count;
}

/* The lowest probability c such that the tokens at or above it hold every token the filters
 * may keep: the first k, or (no top-k) the first of top-p's mass, or (min-p alone) min-p's. */
static float threshold(int64_t n, int64_t k, float p, float min_p, double total) {
    if (k == 0 && p >= 1.0f) return min_p;
    for (float c = 1e-4f; c >= 1e-30f; c *= 1e-4f) {
        double mass;
        int64_t count = at_least(n, c, &mass);
        /* top-p's share with a margin: this mass is summed in another order than the draw's */
        if (k > 0 ? count >= k : mass >= p * total * (1.0 + 1e-6)) return c;
    }
    return 0.0f;
}

/* How many of the sorted candidates the filters keep (at least one): top-k, then top-p over the
 * top-k tokens' mass, then min-p against the largest probability (1). */
static int64_t kept(int64_t count, int64_t k, float p, float min_p, double total) {
    int64_t keep = k > 0 && k < count ? k : count;
    if (k > 0) {
        total = 0.0;
        for (int64_t j = 0; j < keep; j++) total += cands[j].p;
    }
    if (p < 1.0f) {
        double before = 0.0;
        for (int64_t j = 0; j < keep; j++) {
            if (before >= p * total) {
                keep = j;
                break;
            }
            before += cands[j].p;
        }
    }
    for (int64_t j = 0; j < keep; j++)
        if (cands[j].p < min_p) {
            keep = j;
            break;
        }
    return keep > 0 ? keep : 1;
}

static int64_t sample_row(const float *x, int64_t n, float t, int64_t k, float p, float min_p, double u) {
    double total = scaled_exp(x, n, t);
    if (!(total > 0.0)) return 0; /* every logit -inf: token 0, as argmax */
    if (k < 0 || k >= n) k = 0;
    if (k == 0 && p >= 1.0f && min_p <= 0.0f) { /* no filter: the whole vocabulary, by token id */
        double target = u * total, acc = 0.0;
        int64_t last = 0;
        for (int64_t i = 0; i < n; i++)
            if (probs[i] > 0.0f) {
                acc += probs[i];
                last = i;
                if (acc > target) return i;
            }
        return last;
    }
    int64_t count = gather(n, threshold(n, k, p, min_p, total));
    int64_t keep = kept(count, k, p, min_p, total);
    double mass = 0.0, acc = 0.0;
    for (int64_t j = 0; j < keep; j++) mass += cands[j].p;
    for (int64_t j = 0; j < keep; j++) {
        acc += cands[j].p;
        if (acc > u * mass) return cands[j].id;
    }
    return cands[keep - 1].id;
}

/* out[r]: the token drawn for row r of x [rows, n] at temperature temps[r] (> 0), with top_ks[r]
 * (0: off), top_ps[r] (>= 1: off), min_ps[r] (0: off) and the uniform number uniforms[r] in [0, 1).
 * Returns 0, or -1 when scratch memory cannot be had. */
int sample_rows(const float *x, int64_t rows, int64_t n, const float *temps, const int64_t *top_ks,
                const float *top_ps, const float *min_ps, const double *uniforms, int64_t *out) {
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) if (rows > 1) reduction(| : failed)
    for (int64_t r = 0; r < rows; r++) {
        if (scratch(n)) {
            failed = 1;
            continue;
        }
        out[r] = sample_row(x + r * n, n, temps[r], top_ks[r], top_ps[r], min_ps[r], uniforms[r]);
    }
    return failed ? -1 : 0;
}
