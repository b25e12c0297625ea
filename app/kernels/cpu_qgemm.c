/* Weight-quantized GEMM for x86 CPUs with AVX2, FMA and F16C (llama.cpp's way of multiplying on
 * the CPU): a decode step reads 5 (q4), 6 (q5), 6.5625 (q6) or 8.5 (q8) bits a weight.
 *
 * y[M, N] = x[M, K] @ W[N, K]^T with W stored in groups of 32 along K:
 *   q4: w = d * level + m, level 0..15, d and m fp16 per group (a Q4_1 block's numbers);
 *   q4k: the same with d = d' * scale and m = m' * min, d' and m' fp16 per 8 groups, scale and min
 *        0..63 per group (Q4_K's numbers: the products are exact in fp32);
 *   q5: the same with levels 0..31 (Q5_0 / Q5_1 blocks);
 *   q4_0, q5_0: q4 and q5 with m = -8 d and -16 d (Q4_0, Q5_0), made here, not stored;
 *   q6: w = d * sc * (level - 32), level 0..63, sc int8 per 16 weights, d fp16 per 8 groups (Q6_K);
 *   q8: w = d * level, level -127..127 (int8), d fp16 per group.
 * The weights come in tiles of 8 rows, interleaved so that a tile is read front to back (the
 * hardware prefetcher then streams it) and so that each row's partial dot product lands in its own
 * lane of a vector (lane j: row j, four consecutive levels):
 *   q4: [N/8][K/32][4][8 rows][4 bytes]: byte b of row j in vector s holds level 4s+b in its low
 *       nibble and level 16+4s+b in its high one;
 *   q5: q4's nibbles, and the 5th bits in [N/8][K/32][32 bytes] (see fifth_bits);
 *   q6: [N/8][K/32][192 bytes]: q4's nibbles, then the top two bits (cpu_qgemm_tiles.h, q6_unpack);
 *   q8: [N/8][K/32][8][8 rows][4 levels]: levels 4s .. 4s+3 in vector s.
 * Scale tables are tiled the same way, [N/8][groups][8 rows] (q6's and q4k's d and m per block of
 * 8 groups; q4k's scales and mins [N/8][groups][2][8 rows] bytes), and N is padded to whole tiles.
 * Each row of x is quantized per group of 32 to int8 (scale absmax / 127, round to nearest even),
 * as llama.cpp's Q8 activations are; a group's dot product is then exact integer arithmetic
 * (maddubs / madd), scaled once. Every output is computed from its own row in the same order
 * whatever M is: batch-invariant by construction, so every batch size, prefill chunks included,
 * goes through these loops.
 *
 * Built with the other cpu_*.c files into one library (cpu_build.py) with -fopenmp: its runtime is
 * the libgomp that torch has already loaded, so its threads are torch's.
 */
#include "cpu_kernels.h"
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* One group of 32 floats -> 32 int8 in order (round to nearest even), its scale, scale * the sum
 * of its levels, and the sums of its two halves' levels as two int16 (q6's offset). */
static inline void quantize_group(const float *x, int8_t *q, float *scale, float *sum, int32_t *halves) {
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
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    /* The m term multiplies the sum of the quantized activations, as a dense GEMM over them would. */
    const int lo = hsum_epi32(_mm256_add_epi32(i32[0], i32[1])), hi = hsum_epi32(_mm256_add_epi32(i32[2], i32[3]));
    *sum = d * (float)(lo + hi);
    *halves = (int32_t)(uint16_t)(int16_t)lo | (int32_t)((uint32_t)(uint16_t)(int16_t)hi << 16);
}

#define TILE 8 /* weight rows per tile: one per lane of an 8 x fp32 vector */
#define ROW_BLOCK_BYTES (96 * 1024) /* x levels per block of rows: they stay in L2 while weights pass */

typedef struct {
    int64_t M, K, G, N; /* G = K / 32 */
    const void *qs;
    const uint16_t *d, *m; /* weight scales (and q4/q5 minimums), tiled */
    const uint8_t *qh;     /* q5's 5th bits; NULL for q4 and q8 */
    int8_t *xq;            /* activation levels, rows interleaved in blocks of 8: see x_at */
    float *xd, *xs;        /* activation scales, and scale * level sums: [M/8][G][8] */
    int32_t *xb;           /* the level sums of each group's two halves, int16 each: [M/8][G][8] */
    const int8_t *sc;      /* q6's sub-scales, q4k's scales and mins; NULL for the others */
    float *y;              /* this part's first output column */
    int64_t ldy;           /* y's row stride: the whole matrix's outputs */
    int fmt;               /* QG_Q8 .. QG_Q5_0 */
} gemm_args;

static inline __m256 load_ph(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* The activations come in blocks of 8 rows, group by group: [M/8][G][8 rows][32 levels], so that a
 * kernel reaches its R rows from one pointer at constant offsets; the scale tables likewise,
 * [M/8][G][8]. */
static inline int64_t x_at(int64_t r, int64_t K) { return r / TILE * K * TILE + r % TILE * 32; }
static inline int64_t tab_at(int64_t r, int64_t G) { return r / TILE * G * TILE + r % TILE; }

/* Four activation levels (k .. k+3 of a row) in every 32-bit lane. */
static inline __m256i bcast4(const int8_t *x) {
    int32_t v;
    __builtin_memcpy(&v, x, 4);
    return _mm256_set1_epi32(v);
}

/* Every output y[r, n] is, over the groups g in order,
 *     acc = fma(d[n, g] * xd[r, g], (float)dot_int(w[n, g], x[r, g]), acc)
 *     mac = fma(m[n, g], xs[r, g], mac)            (q4 and q5)
 * and then acc + mac, in lane n % 8 of a tile. The integer dot is exact, so neither the batch size
 * nor the row blocking below changes a bit of any output.
 *
 * A weight tile's vector holds four consecutive levels of each of its 8 rows, one row per 32-bit
 * lane; the activations' matching four levels are broadcast to every lane. maddubs + madd then
 * leave each row's partial dot in its own lane: no horizontal sums (six hadds a tile and group,
 * where the rows lay side by side, were a large share of the time). A tile's weights are loaded
 * (and unpacked) once for R activation rows. */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* The weights stream from memory once a step (a decode step is bound by it): the cache lines
 * PREFETCH_DISTANCE ahead of a group's `bytes` are asked for now, which beat the hardware prefetcher
 * alone and nearer or farther distances (docs/tuning.md). __builtin_prefetch: gcc 12 dropped
 * _mm_prefetch's in this loop. */
#define PREFETCH_DISTANCE 1024
ALWAYS_INLINE void prefetch_ahead(const void *p, const int bytes) {
    const char *c = (const char *)p + PREFETCH_DISTANCE;
    for (int off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
}

/* The 5th bits of q5 levels: of a group's 32 bytes, byte 4j+b holds in bit 2s+p the 5th bit of row
 * j's level 16p+4s+b (nibble vector s, plane p: 0 low nibbles, 1 high). One shift and one mask
 * move a (s, p)'s bits to 0x10 in every byte (16-bit shifts: bits crossing a byte are masked). */
static inline __m256i fifth_bits(__m256i h, const int k) {
    const __m256i bit4 = _mm256_set1_epi8(0x10);
    if (k < 4)
        h = _mm256_slli_epi16(h, 4 - k);
    else if (k > 4)
        h = _mm256_srli_epi16(h, k - 4);
    return _mm256_and_si256(h, bit4);
}

/* The tile kernels, once per instruction set: AVX2 here, AVX-512 VNNI below for the CPUs that have it
 * (chosen once at run time, see qgemm_isa). Both sum the same exact integer dots and then run the
 * same float operations in the same order: their outputs are identical, bit for bit. */
#define QG_VNNI 0
#define QG(name) name##_avx2
#include "cpu_qgemm_tiles.h"
#undef QG_VNNI
#undef QG

#define PANEL_GROUP_BYTES 768 /* a panel's group: 8 unpacked zmm vectors, d, m, q6's two sub-scale vectors */

/* Only the functions below may use AVX-512 instructions; nothing runs them on a CPU without them. */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512vnni")
#define QG_VNNI 1
#define QG(name) name##_vnni
#include "cpu_qgemm_tiles.h"
#undef QG_VNNI
#undef QG
#pragma GCC pop_options

typedef void (*tile_rows_fn)(const gemm_args *, int64_t, int64_t, int64_t);
typedef void (*pair_rows_fn)(const gemm_args *, int64_t, int64_t, int64_t, int64_t);
typedef void (*panel_rows_fn)(const gemm_args *, char *, int64_t, int, int64_t, int64_t);

#define PAIR_BLOCK_ROWS 32 /* the least rows a block of x holds on the pairs' path */
#define PANEL_MIN_ROWS 32  /* prefill: from this many rows the pairs go through panels */
#define PANEL_BLOCK_BYTES (1024 * 1024) /* x levels per block of rows on the panels' path (L2) */

/* Quantize x once, then every tile of each part. Each thread owns a contiguous share of each
 * part's weight tiles; x is walked in blocks of rows whose levels fit in L2 while the thread's
 * weights pass over each block, each tile staying in L1 for the block's rows. */
static inline void run_gemm(const gemm_args *parts, int nparts, const float *x, int nthreads, tile_rows_fn tile_rows,
                            pair_rows_fn pair_rows, panel_rows_fn panel_rows, char *panels) {
    const gemm_args *a = parts;
    const int64_t M = a->M, G = a->G;
    const int panel = panel_rows && M >= PANEL_MIN_ROWS;
    int64_t block = (panel ? PANEL_BLOCK_BYTES : ROW_BLOCK_BYTES) / a->K / TILE * TILE;
    if (block < TILE) block = TILE;
    /* the pairs take 16 rows a pass: a wide K's block (down's) gets them, its levels still in L2 */
    if (pair_rows && block < PAIR_BLOCK_ROWS) block = PAIR_BLOCK_ROWS;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++)
            for (int64_t g = 0; g < G; g++)
                quantize_group(x + r * a->K + g * QK, a->xq + x_at(r, a->K) + g * QK * TILE, a->xd + tab_at(r, G) + g * TILE,
                               a->xs + tab_at(r, G) + g * TILE, a->xb + tab_at(r, G) + g * TILE);
        int th = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int p = 0; p < nparts; p++) {
            const int64_t tiles = (parts[p].N + TILE - 1) / TILE, t0 = tiles * th / nt, t1 = tiles * (th + 1) / nt;
            for (int64_t b = 0; b < M; b += block) {
                int64_t end = b + block < M ? b + block : M;
                int64_t t = t0;
                char *mine = panels + th * 2 * G * PANEL_GROUP_BYTES;
                if (panel) {
                    for (; t + 3 < t1; t += 4) panel_rows(&parts[p], mine, t, 4, b, end);
                    if (t + 1 < t1) panel_rows(&parts[p], mine, t, 2, b, end), t += 2;
                }
                if (pair_rows) { /* tile i of the first half with tile i of the second: two long streams */
                    const int64_t span = (t1 - t) / 2;
                    for (int64_t i = 0; i < span; i++) pair_rows(&parts[p], t + i, span, b, end);
                    t += 2 * span;
                }
                for (; t < t1; t++) tile_rows(&parts[p], t, b, end);
            }
        }
    }
}


/* The quantized activations of the calling thread's last call: their levels, then two fp32
 * tables (both in blocks of 8 rows, see x_at). Grown as needed, never shrunk (at most a prefill chunk's
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

/* The instruction set the tiles run with: AVX-512 VNNI where the CPU (and the OS, for its registers)
 * has it, else AVX2; LOCALBATCH_CPU_ISA=avx2 keeps AVX2 anyway. Chosen at the first call. Some VMs
 * list features that fault (AMX): only what __builtin_cpu_supports confirms is used. */
enum { ISA_AVX2 = 0, ISA_VNNI = 1 };
static int isa_choice = -1;

static int isa_detect(void) {
    const char *forced = getenv("LOCALBATCH_CPU_ISA");
    if (forced && forced[0] && strcmp(forced, "avx512vnni") != 0)
        return ISA_AVX2;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                   __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni")
               ? ISA_VNNI
               : ISA_AVX2;
}

int qgemm_isa(void) {
    if (isa_choice < 0)
        isa_choice = isa_detect();
    return isa_choice;
}

/* Tests run both paths on one machine: `isa` if this CPU has it (returns 0), else -1. */
int qgemm_set_isa(int isa) {
    if (isa == ISA_VNNI && isa_detect() != ISA_VNNI)
        return -1;
    isa_choice = isa == ISA_VNNI ? ISA_VNNI : ISA_AVX2;
    return 0;
}

#define MAX_PARTS 4 /* of a SplitWeight */

/* y [M, N] = x [M, K] fp32 @ W^T, W's parts (w, w->next, ...) giving y's columns in turn. Returns 0,
 * or -1 when the scratch cannot be allocated or W has more than MAX_PARTS parts. */
int qgemm(const qweight *w, const float *x, int64_t M, float *y, int nthreads) {
    const int64_t G = w->K / QK, blocks = (M + TILE - 1) / TILE;
    const size_t levels = ((size_t)blocks * TILE * w->K + 63) / 64 * 64, table = ((size_t)blocks * TILE * G * 4 + 63) / 64 * 64;
    int64_t N = 0;
    int nparts = 0;
    for (const qweight *p = w; p; p = p->next, nparts++)
        N += p->N;
    const int vnni = qgemm_isa() == ISA_VNNI;
    const size_t panels = vnni && M >= PANEL_MIN_ROWS ? (size_t)nthreads * 2 * G * PANEL_GROUP_BYTES : 0;
    char *buf = scratch_for(levels + 3 * table + panels);
    if (!buf || nparts > MAX_PARTS)
        return -1;
    gemm_args parts[MAX_PARTS];
    int64_t col = 0;
    for (int i = 0; i < nparts; col += w->N, w = w->next, i++)
        parts[i] = (gemm_args){M, w->K, G, w->N, w->qs, w->d, w->m, w->qh, (int8_t *)buf, (float *)(buf + levels),
                               (float *)(buf + levels + table), (int32_t *)(buf + levels + 2 * table), w->sc, y + col,
                               N, (int)w->fmt};
    run_gemm(parts, nparts, x, nthreads, vnni ? tile_rows_vnni : tile_rows_avx2, vnni ? pair_rows_vnni : NULL,
             vnni ? panel_rows_vnni : NULL, buf + levels + 3 * table);
    return 0;
}
