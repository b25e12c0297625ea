/* Weight-quantized GEMM for x86 CPUs with AVX2, FMA and F16C (llama.cpp's way of multiplying on
 * the CPU): a decode step reads 5 (q4) or 8.5 (q8) bits a weight.
 *
 * y[M, N] = x[M, K] @ W[N, K]^T with W stored in groups of 32 along K:
 *   q4: w = d * level + m, level 0..15, d and m fp16 per group (a Q4_1 block's numbers);
 *   q8: w = d * level, level -127..127 (int8), d fp16 per group.
 * The weights come in tiles of 8 rows, interleaved so that a tile is read front to back: the
 * hardware prefetcher then streams it (8 rows read side by side at a row's stride ran at a third
 * of the memory bandwidth):
 *   q4: [N/8][K/64][8 rows][32 bytes]: a row's two groups 2p and 2p+1, 16 bytes each; byte i of a
 *       group holds level i in its low nibble and level i + 16 in its high one. One 32-byte load
 *       and two masks give both groups' levels (an odd last group is padded with zeros);
 *   q8: [N/8][K/32][8 rows][32 levels].
 * Scale tables are tiled the same way, [N/8][groups][8 rows], and N is padded to whole tiles.
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
#include <stdlib.h>

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

/* One group of 32 floats -> 32 int8 (round to nearest even; levels 0..15 to lo, 16..31 to hi), its
 * scale, and scale * the sum of its levels. */
static inline void quantize_group(const float *x, int8_t *lo, int8_t *hi, float *scale, float *sum) {
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
    _mm_storeu_si128((__m128i *)lo, _mm256_castsi256_si128(p));
    _mm_storeu_si128((__m128i *)hi, _mm256_extracti128_si256(p, 1));
    /* The m term multiplies the sum of the quantized activations, as a dense GEMM over them would. */
    __m256i t = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
    *sum = d * (float)hsum_epi32(t);
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

/* The same for vectors whose 128-bit halves hold two groups: lane i of *lo sums s[i]'s low half,
 * lane i of *hi its high half. */
static inline void reduce8_halves(const __m256i *s, __m256i *lo, __m256i *hi) {
    __m256i t0 = _mm256_hadd_epi32(s[0], s[1]), t1 = _mm256_hadd_epi32(s[2], s[3]);
    __m256i t2 = _mm256_hadd_epi32(s[4], s[5]), t3 = _mm256_hadd_epi32(s[6], s[7]);
    __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
    *lo = _mm256_permute2x128_si256(u0, u1, 0x20);
    *hi = _mm256_permute2x128_si256(u0, u1, 0x31);
}

typedef struct {
    int64_t M, K, G, N; /* G: groups in the tables and in a row of xq (q4: padded to even) */
    const void *qs;
    const uint16_t *d, *m; /* weight scales (and q4 minimums), tiled */
    int8_t *xq;            /* [M, G * 32]: q4 in the pair order below, q8 in K order */
    float *xd, *xs;        /* activation scales and scaled level sums, tiled */
    float *y;
} gemm_args;

/* Scales come in tiles of 8 rows: element (row, group) of a [rows, G] table sits at
 * [row / 8][group][row % 8], so a tile's eight scales for one group are one vector load. */
static inline int64_t tiled(int64_t row, int64_t g, int64_t G) { return (row / TILE) * G * TILE + g * TILE + row % TILE; }

/* Every output y[r, n] is, over the groups g in order,
 *     acc = fma(d[n, g] * xd[r, g], (float)dot_int(w[n, g], x[r, g]), acc)
 *     mac = fma(m[n, g], xs[r, g], mac)            (q4 only)
 * and then acc + mac, in one lane of a tile. The two tile shapes below (eight weight rows against
 * one activation row, one weight row against eight activation rows) compute exactly that, so
 * neither the batch size nor the tiling changes a bit of any output. */
static inline __m256 accumulate(__m256 acc, __m256 scale, __m256i dot) {
    return _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(dot), acc);
}

static inline __m256 load_ph(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline __m256 bcast_ph(uint16_t h) { return _mm256_set1_ps(_cvtsh_ss(h)); }

/* q4, a pair of groups: 32 weight bytes (group 2p's 16, then 2p+1's) against the activations in
 * pair order (xq: group 2p's levels 0..15, 2p+1's 0..15, then both groups' 16..31). The int16
 * sums of maddubs stay below 2 * 2 * 15 * 127: exact. Lanes 0-3 of the result hold group 2p's
 * partial sums, lanes 4-7 group 2p+1's. */
static inline __m256i q4_pair_dot(__m256i lo, __m256i hi, const int8_t *xq) {
    __m256i xl = _mm256_loadu_si256((const __m256i *)xq), xh = _mm256_loadu_si256((const __m256i *)(xq + 32));
    __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

static inline void q4_unpack(const uint8_t *w, __m256i *lo, __m256i *hi) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    __m256i b = _mm256_loadu_si256((const __m256i *)w);
    *lo = _mm256_and_si256(b, mask);
    *hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
}

/* Signed . signed: maddubs wants one operand unsigned, so |x| times the weights with x's signs. */
static inline __m256i q8_dot(const int8_t *w, __m256i x, __m256i ax) {
    __m256i sw = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)w), x);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sw), _mm256_set1_epi16(1));
}

/* Weight tile t (rows 8t .. 8t+7) against activation row r. */
static void q4_tile_n8(const gemm_args *a, int64_t t, int64_t r) {
    const int64_t G = a->G;
    const uint8_t *w = (const uint8_t *)a->qs + t * G * TILE * 16;
    const uint16_t *dt = a->d + t * G * TILE, *mt = a->m + t * G * TILE;
    const int8_t *x = a->xq + r * G * 32;
    __m256 acc = _mm256_setzero_ps(), mac = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g += 2, w += TILE * 32, x += 64) {
        __m256i s[TILE], lo, hi, g0, g1;
        for (int j = 0; j < TILE; j++) {
            q4_unpack(w + j * 32, &lo, &hi);
            s[j] = q4_pair_dot(lo, hi, x);
        }
        reduce8_halves(s, &g0, &g1);
        for (int h = 0; h < 2; h++) {
            __m256 scale = _mm256_mul_ps(load_ph(dt + (g + h) * TILE), _mm256_set1_ps(a->xd[tiled(r, g + h, G)]));
            acc = accumulate(acc, scale, h ? g1 : g0);
            mac = _mm256_fmadd_ps(load_ph(mt + (g + h) * TILE), _mm256_set1_ps(a->xs[tiled(r, g + h, G)]), mac);
        }
    }
    float out[TILE];
    _mm256_storeu_ps(out, _mm256_add_ps(acc, mac));
    for (int j = 0; j < TILE && t * TILE + j < a->N; j++) a->y[r * a->N + t * TILE + j] = out[j];
}

/* Weight row n against activation rows r .. r+7 (r a multiple of 8, all below M). */
static void q4_tile_r8(const gemm_args *a, int64_t n, int64_t r) {
    const int64_t G = a->G, t = n / TILE, j = n % TILE;
    const uint8_t *w = (const uint8_t *)a->qs + t * G * TILE * 16 + j * 32;
    const float *xdt = a->xd + (r / TILE) * G * TILE, *xst = a->xs + (r / TILE) * G * TILE;
    __m256 acc = _mm256_setzero_ps(), mac = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g += 2, w += TILE * 32) {
        __m256i s[TILE], lo, hi, g0, g1;
        q4_unpack(w, &lo, &hi);
        for (int i = 0; i < TILE; i++) s[i] = q4_pair_dot(lo, hi, a->xq + (r + i) * G * 32 + g * 32);
        reduce8_halves(s, &g0, &g1);
        for (int h = 0; h < 2; h++) {
            __m256 scale = _mm256_mul_ps(bcast_ph(a->d[tiled(n, g + h, G)]), _mm256_loadu_ps(xdt + (g + h) * TILE));
            acc = accumulate(acc, scale, h ? g1 : g0);
            mac = _mm256_fmadd_ps(bcast_ph(a->m[tiled(n, g + h, G)]), _mm256_loadu_ps(xst + (g + h) * TILE), mac);
        }
    }
    float out[TILE];
    _mm256_storeu_ps(out, _mm256_add_ps(acc, mac));
    for (int i = 0; i < TILE; i++) a->y[(r + i) * a->N + n] = out[i];
}

static void q8_tile_n8(const gemm_args *a, int64_t t, int64_t r) {
    const int64_t G = a->G;
    const int8_t *w = (const int8_t *)a->qs + t * G * TILE * 32;
    const uint16_t *dt = a->d + t * G * TILE;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++, w += TILE * 32) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(a->xq + r * G * 32 + g * 32)), ax = _mm256_sign_epi8(x, x);
        __m256i s[TILE];
        for (int j = 0; j < TILE; j++) s[j] = q8_dot(w + j * 32, x, ax);
        __m256 scale = _mm256_mul_ps(load_ph(dt + g * TILE), _mm256_set1_ps(a->xd[tiled(r, g, G)]));
        acc = accumulate(acc, scale, reduce8_epi32(s));
    }
    float out[TILE];
    _mm256_storeu_ps(out, acc);
    for (int j = 0; j < TILE && t * TILE + j < a->N; j++) a->y[r * a->N + t * TILE + j] = out[j];
}

/* Row r of x [M, K] quantized into the kernel's order: q4 in pairs of groups (an odd last group
 * padded with zero levels and scales), q8 in K order. */
static void quantize_row(const gemm_args *a, const float *x, int64_t r, int q4) {
    const int64_t G = a->G, real = a->K / QK;
    int8_t *xq = a->xq + r * G * 32;
    float *xd = a->xd, *xs = a->xs;
    for (int64_t g = 0; g < G; g++) {
        int8_t *lo = q4 ? xq + (g / 2) * 64 + (g % 2) * 16 : xq + g * 32, *hi = q4 ? lo + 32 : lo + 16;
        if (g < real) {
            quantize_group(x + r * a->K + g * QK, lo, hi, xd + tiled(r, g, G), xs + tiled(r, g, G));
        } else {
            for (int i = 0; i < 16; i++) lo[i] = hi[i] = 0;
            xd[tiled(r, g, G)] = xs[tiled(r, g, G)] = 0.0f;
        }
    }
}

/* Quantize x, then every tile. Each thread owns a contiguous share of the weight tiles; x is
 * walked in blocks of rows whose levels fit in L2 while the thread's weights pass over each block.
 * q4 takes the one-weight-row tiles for whole groups of 8 rows (each weight pair is unpacked once
 * for 8 rows), and the eight-weight-row tiles for the rest (all of a decode step's rows, when
 * there are fewer than 8). q8 has nothing to unpack: the eight-weight-row tiles serve every row
 * (as cheap, and they read a weight tile front to back, where one weight row's 32-byte pieces lie
 * 256 bytes apart: Gemma 3's 262k-row head at 16 rows, 22 -> 14 ms), each tile staying in L1 for
 * the block's rows. */
static inline void run_gemm(const gemm_args *a, const float *x, int nthreads, int q4) {
    const int64_t M = a->M, full = M / TILE * TILE, tiles = (a->N + TILE - 1) / TILE;
    int64_t block = ROW_BLOCK_BYTES / (a->G * 32) / TILE * TILE;
    if (block < TILE) block = TILE;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++) quantize_row(a, x, r, q4);
        int th = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t t0 = tiles * th / nt, t1 = tiles * (th + 1) / nt;
        int64_t n1 = t1 * TILE < a->N ? t1 * TILE : a->N;
        if (q4) {
            for (int64_t b = 0; b < full; b += block)
                for (int64_t n = t0 * TILE; n < n1; n++)
                    for (int64_t r = b; r < b + block && r < full; r += TILE)
                        q4_tile_r8(a, n, r);
            for (int64_t t = t0; t < t1; t++)
                for (int64_t r = full; r < M; r++)
                    q4_tile_n8(a, t, r);
        } else {
            for (int64_t b = 0; b < M; b += block)
                for (int64_t t = t0; t < t1; t++)
                    for (int64_t r = b; r < b + block && r < M; r++)
                        q8_tile_n8(a, t, r);
        }
    }
}

/* A weight as Q4Weight / Q8Weight (cpu_qgemm.py) lay it out: built once per matrix, so a call
 * passes one pointer for it. */
typedef struct {
    int64_t K, N;
    const void *qs;
    const uint16_t *d, *m; /* m: NULL for q8 */
} qweight;

/* The quantized activations of the calling thread's last call: [M, G * 32] levels, then two
 * [ceil(M / 8) * 8 * G] fp32 tables. Grown as needed, never shrunk (at most a prefill chunk's
 * worth); one per calling thread, so engines in two threads never share one. */
static __thread void *scratch;
static __thread size_t scratch_bytes;

static void *scratch_for(size_t bytes) {
    if (bytes > scratch_bytes) {
        free(scratch);
        bytes = (bytes + 4095) / 4096 * 4096;
        scratch = aligned_alloc(64, bytes);
        scratch_bytes = scratch ? bytes : 0;
    }
    return scratch;
}

/* y [M, N] = x [M, K] fp32 @ W^T. Returns 0, or -1 when the scratch cannot be allocated. */
int qgemm(const qweight *w, const float *x, int64_t M, float *y, int nthreads) {
    const int q4 = w->m != NULL;
    const int64_t G = q4 ? (w->K / QK + 1) / 2 * 2 : w->K / QK;
    const size_t levels = ((size_t)M * G * 32 + 63) / 64 * 64, table = (size_t)(M + TILE - 1) / TILE * TILE * G * 4;
    char *buf = scratch_for(levels + 2 * table);
    if (!buf)
        return -1;
    gemm_args a = {M, w->K, G, w->N, w->qs, w->d, w->m, (int8_t *)buf, (float *)(buf + levels),
                   (float *)(buf + levels + table), y};
    run_gemm(&a, x, nthreads, q4);
    return 0;
}
