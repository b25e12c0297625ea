/* The inner loop of the AVX-512 VNNI panels (app/kernels/cpu_qgemm_tiles.h, panel_group) for Q4_K and
 * Q6_K, with the app's arithmetic (int8 activations with a scale per 32: a float convert, multiply
 * and FMA per group and row; Q6_K's halves as two fp32 products) against llama.cpp's Q8_K form (a
 * scale per 256, the group scales applied to the int32 group dots as integers, the minimums /
 * Q6_K's -32 through per-block level sums, one float convert per 256). Same register tile as the
 * app's (2 pairs x 4 rows), one thread, the panels and 512 rows of levels in cache: what each
 * form's instructions allow, apart from unpacking, quantizing and memory. Run by
 * benchmarks/kernels/q8k_panel.py; prints one "name GMAC/s" line per form and repeat. Synthetic
 * numbers: the outputs are not checked. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#define AI static inline __attribute__((always_inline))
enum { G = 48, M = 512, W = 2, R = 4 };
static double now(void) { struct timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

/* panel: per pair per group 8 vectors (512 B) + dv + mv (+ q8k: sc int32 vector) */
typedef struct { __m512i v[8]; __m512 dv, mv; __m512i sc; } pgroup;
typedef struct { __m512 d, dmin; __m512i mins[4]; } pblock; /* q8k per block: mins as int16 pairs (g, g+1) */
static pgroup P[W][G] __attribute__((aligned(64)));
static pblock PB[W][G / 8] __attribute__((aligned(64)));
static int8_t X[M / 8][G][8][32] __attribute__((aligned(64)));
static float XD[M / 8][G][8], XS[M / 8][G][8];
static float XD8[M / 8][G / 8][8];
static int32_t XB[M / 8][G / 8][8][4]; /* group sums as int16 pairs */
static float Y[M][32];

AI __m512i bc(const int8_t *p) { return _mm512_set1_epi32(*(const int32_t *)p); }

__attribute__((noinline)) static void cur(void) {
    for (int r = 0; r < M; r += R) {
        const int b = r / 8, o = r % 8;
        __m512 acc[W * R], mac[W * R];
        for (int i = 0; i < W * R; i++) acc[i] = mac[i] = _mm512_setzero_ps();
        for (int g = 0; g < G; g++) {
            __m512i dot[W][R];
#pragma GCC unroll 8
            for (int w = 0; w < W; w++)
#pragma GCC unroll 8
                for (int i = 0; i < R; i++) dot[w][i] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int s = 0; s < 8; s++) {
                __m512i v0 = _mm512_load_si512(&P[0][g].v[s]), v1 = _mm512_load_si512(&P[1][g].v[s]);
                const int off = 16 * (s / 4) + 4 * (s % 4);
#pragma GCC unroll 8
                for (int i = 0; i < R; i++) {
                    __m512i xv = bc(&X[b][g][o + i][off]);
                    dot[0][i] = _mm512_dpbusd_epi32(dot[0][i], v0, xv);
                    dot[1][i] = _mm512_dpbusd_epi32(dot[1][i], v1, xv);
                }
            }
#pragma GCC unroll 8
            for (int w = 0; w < W; w++)
#pragma GCC unroll 8
                for (int i = 0; i < R; i++)
                    acc[w * R + i] = _mm512_fmadd_ps(_mm512_mul_ps(P[w][g].dv, _mm512_set1_ps(XD[b][g][o + i])), _mm512_cvtepi32_ps(dot[w][i]), acc[w * R + i]);
        }
        for (int g = 0; g < G; g++)
#pragma GCC unroll 8
            for (int w = 0; w < W; w++)
#pragma GCC unroll 8
                for (int i = 0; i < R; i++) mac[w * R + i] = _mm512_fmadd_ps(P[w][g].mv, _mm512_set1_ps(XS[b][g][o + i]), mac[w * R + i]);
        for (int w = 0; w < W; w++)
            for (int i = 0; i < R; i++) _mm512_storeu_ps(&Y[r + i][16 * w], _mm512_add_ps(acc[w * R + i], mac[w * R + i]));
    }
}

/* Q4_K in Q8_K form. MODE 0: each group's dot in two chains of 16 levels (|dot| <= 16 * 15 * 127 fits
 * int16), each scaled and summed by one vpdpwssd with (sc, 0) pairs; MODE 1: one chain, vpmulld. */
#define Q8K(name, MODE)                                                                                              \
__attribute__((noinline)) static void name(void) {                                                                  \
    for (int r = 0; r < M; r += R) {                                                                                  \
        const int b = r / 8, o = r % 8;                                                                                \
        __m512 acc[W * R];                                                                                             \
        for (int i = 0; i < W * R; i++) acc[i] = _mm512_setzero_ps();                                                  \
        for (int kb = 0; kb < G / 8; kb++) {                                                                           \
            __m512i isum[W][R];                                                                                        \
            _Pragma("GCC unroll 8") for (int w = 0; w < W; w++)                                                      \
            _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) isum[w][i] = _mm512_setzero_si512();                  \
            for (int g = kb * 8; g < kb * 8 + 8; g++) {                                                                \
                __m512i lo[W][R], hi[W][R];                                                                            \
                _Pragma("GCC unroll 8") for (int w = 0; w < W; w++)                                                  \
                _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) lo[w][i] = hi[w][i] = _mm512_setzero_si512();     \
                _Pragma("GCC unroll 8") for (int s = 0; s < 8; s++) {                                                \
                    __m512i v0 = _mm512_load_si512(&P[0][g].v[s]), v1 = _mm512_load_si512(&P[1][g].v[s]);             \
                    const int off = 16 * (s / 4) + 4 * (s % 4);                                                        \
                    _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {                                            \
                        __m512i xv = bc(&X[b][g][o + i][off]);                                                         \
                        if (MODE == 0 && s >= 4) {                                                                     \
                            hi[0][i] = _mm512_dpbusd_epi32(hi[0][i], v0, xv);                                          \
                            hi[1][i] = _mm512_dpbusd_epi32(hi[1][i], v1, xv);                                          \
                        } else {                                                                                       \
                            lo[0][i] = _mm512_dpbusd_epi32(lo[0][i], v0, xv);                                          \
                            lo[1][i] = _mm512_dpbusd_epi32(lo[1][i], v1, xv);                                          \
                        }                                                                                              \
                    }                                                                                                  \
                }                                                                                                      \
                _Pragma("GCC unroll 8") for (int w = 0; w < W; w++) {                                                \
                    const __m512i sc = _mm512_load_si512(&P[w][g].sc);                                                 \
                    _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {                                            \
                        if (MODE == 0) {                                                                               \
                            isum[w][i] = _mm512_dpwssd_epi32(isum[w][i], lo[w][i], sc);                                \
                            isum[w][i] = _mm512_dpwssd_epi32(isum[w][i], hi[w][i], sc);                                \
                        } else                                                                                         \
                            isum[w][i] = _mm512_add_epi32(isum[w][i], _mm512_mullo_epi32(lo[w][i], sc));               \
                    }                                                                                                  \
                }                                                                                                      \
            }                                                                                                          \
            _Pragma("GCC unroll 8") for (int w = 0; w < W; w++) {                                                    \
                _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {                                                \
                    __m512i ms = _mm512_setzero_si512();                                                               \
                    _Pragma("GCC unroll 4") for (int k = 0; k < 4; k++)                                              \
                        ms = _mm512_dpwssd_epi32(ms, PB[w][kb].mins[k], _mm512_set1_epi32(XB[b][kb][o + i][k]));       \
                    const __m512 dx = _mm512_set1_ps(XD8[b][kb][o + i]);                                               \
                    acc[w * R + i] = _mm512_fmadd_ps(_mm512_mul_ps(PB[w][kb].d, dx), _mm512_cvtepi32_ps(isum[w][i]), acc[w * R + i]); \
                    acc[w * R + i] = _mm512_fmadd_ps(_mm512_mul_ps(PB[w][kb].dmin, dx), _mm512_cvtepi32_ps(ms), acc[w * R + i]); \
                }                                                                                                      \
            }                                                                                                          \
        }                                                                                                              \
        for (int w = 0; w < W; w++)                                                                                    \
            for (int i = 0; i < R; i++) _mm512_storeu_ps(&Y[r + i][16 * w], acc[w * R + i]);                          \
    }                                                                                                                  \
}
Q8K(q8k_dpwssd, 0)
Q8K(q8k_mulld, 1)


typedef struct { __m512i v[8]; __m512 dv; __m512i scp, sclo, schi; } q6group;
typedef struct { __m512 d; __m512i sc32[8]; } q6block; /* 32 * sub-scales as int16 pairs (2k, 2k+1) */
static q6group Q6P[W][G] __attribute__((aligned(64)));
static q6block Q6B[W][G / 8] __attribute__((aligned(64)));
static int32_t XH[M / 8][G][8];              /* halves' sums (int16 pair), current */
static int32_t XB16[M / 8][G / 8][8][8];     /* per-16 sums as int16 pairs, q8k */

/* A Q6_K group's two 16-level dots per weight vector and row: `dot` over its first four steps,
 * `hi` over the last four (their sub-scales differ); both kernels below share it. */
AI void q6_group_dots(int b, int o, int g, __m512i dot[W][R], __m512i hi[W][R], int offset) {
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) { /* the app starts each half at -32 x its level sum; Q8_K's form at 0 */
        const int32_t xh = XH[b][g][o + i];
        const __m512i lo = _mm512_set1_epi32(offset ? -32 * (int32_t)(int16_t)xh : 0), up = _mm512_set1_epi32(offset ? -32 * (xh >> 16) : 0);
#pragma GCC unroll 8
        for (int w = 0; w < W; w++) dot[w][i] = lo, hi[w][i] = up;
    }
#pragma GCC unroll 8
    for (int s = 0; s < 8; s++) {
        __m512i v0 = _mm512_load_si512(&Q6P[0][g].v[s]), v1 = _mm512_load_si512(&Q6P[1][g].v[s]);
        const int off = 16 * (s / 4) + 4 * (s % 4);
#pragma GCC unroll 8
        for (int i = 0; i < R; i++) {
            __m512i xv = bc(&X[b][g][o + i][off]);
            if (s >= 4) { hi[0][i] = _mm512_dpbusd_epi32(hi[0][i], v0, xv); hi[1][i] = _mm512_dpbusd_epi32(hi[1][i], v1, xv); }
            else { dot[0][i] = _mm512_dpbusd_epi32(dot[0][i], v0, xv); dot[1][i] = _mm512_dpbusd_epi32(dot[1][i], v1, xv); }
        }
    }
}

__attribute__((noinline)) static void q6cur(void) {
    for (int r = 0; r < M; r += R) {
        const int b = r / 8, o = r % 8;
        __m512 acc[W * R];
        for (int i = 0; i < W * R; i++) acc[i] = _mm512_setzero_ps();
        for (int g = 0; g < G; g++) {
            __m512i dot[W][R], hi[W][R];
            q6_group_dots(b, o, g, dot, hi, 1);
#pragma GCC unroll 8
            for (int w = 0; w < W; w++) {
                const __m512 sclo = _mm512_cvtepi32_ps(_mm512_load_si512(&Q6P[w][g].sclo)), schi = _mm512_cvtepi32_ps(_mm512_load_si512(&Q6P[w][g].schi));
#pragma GCC unroll 8
                for (int i = 0; i < R; i++) {
                    const __m512 d = _mm512_fmadd_ps(sclo, _mm512_cvtepi32_ps(dot[w][i]), _mm512_mul_ps(schi, _mm512_cvtepi32_ps(hi[w][i])));
                    acc[w * R + i] = _mm512_fmadd_ps(_mm512_mul_ps(Q6P[w][g].dv, _mm512_set1_ps(XD[b][g][o + i])), d, acc[w * R + i]);
                }
            }
        }
        for (int w = 0; w < W; w++)
            for (int i = 0; i < R; i++) _mm512_storeu_ps(&Y[r + i][16 * w], acc[w * R + i]);
    }
}

__attribute__((noinline)) static void q6q8k(void) {
    for (int r = 0; r < M; r += R) {
        const int b = r / 8, o = r % 8;
        __m512 acc[W * R];
        for (int i = 0; i < W * R; i++) acc[i] = _mm512_setzero_ps();
        for (int kb = 0; kb < G / 8; kb++) {
            __m512i isum[W][R];
#pragma GCC unroll 8
            for (int w = 0; w < W; w++)
#pragma GCC unroll 8
                for (int i = 0; i < R; i++) isum[w][i] = _mm512_setzero_si512();
            for (int g = kb * 8; g < kb * 8 + 8; g++) {
                __m512i dot[W][R], hi[W][R];
                q6_group_dots(b, o, g, dot, hi, 0);
#pragma GCC unroll 8
                for (int w = 0; w < W; w++) {
                    const __m512i sclo = _mm512_load_si512(&Q6P[w][g].sclo), schi = _mm512_load_si512(&Q6P[w][g].schi);
#pragma GCC unroll 8
                    for (int i = 0; i < R; i++)
                        isum[w][i] = _mm512_add_epi32(isum[w][i], _mm512_add_epi32(_mm512_mullo_epi32(dot[w][i], sclo), _mm512_mullo_epi32(hi[w][i], schi)));
                }
            }
#pragma GCC unroll 8
            for (int w = 0; w < W; w++)
#pragma GCC unroll 8
                for (int i = 0; i < R; i++) {
                    __m512i off = _mm512_setzero_si512();
#pragma GCC unroll 8
                    for (int k = 0; k < 8; k++) off = _mm512_dpwssd_epi32(off, Q6B[w][kb].sc32[k], _mm512_set1_epi32(XB16[b][kb][o + i][k]));
                    acc[w * R + i] = _mm512_fmadd_ps(_mm512_mul_ps(Q6B[w][kb].d, _mm512_set1_ps(XD8[b][kb][o + i])), _mm512_cvtepi32_ps(_mm512_sub_epi32(isum[w][i], off)), acc[w * R + i]);
                }
        }
        for (int w = 0; w < W; w++)
            for (int i = 0; i < R; i++) _mm512_storeu_ps(&Y[r + i][16 * w], acc[w * R + i]);
    }
}

static void fill(void) {
    srand(1);
    char *p = (char *)P;
    for (size_t i = 0; i < sizeof P; i++) p[i] = rand() & 15;
    for (int w = 0; w < W; w++) for (int g = 0; g < G; g++) { P[w][g].dv = _mm512_set1_ps(1e-3f); P[w][g].mv = _mm512_set1_ps(-1e-3f); P[w][g].sc = _mm512_set1_epi32(rand() & 63); }
    for (int w = 0; w < W; w++) for (int k = 0; k < G / 8; k++) { PB[w][k].d = _mm512_set1_ps(1e-3f); PB[w][k].dmin = _mm512_set1_ps(-1e-3f); for (int j = 0; j < 4; j++) PB[w][k].mins[j] = _mm512_set1_epi16(rand() & 63); }
    { char *q = (char *)Q6P; for (size_t i = 0; i < sizeof Q6P; i++) q[i] = rand() & 63; }
    for (int w = 0; w < W; w++) { for (int g = 0; g < G; g++) Q6P[w][g].dv = _mm512_set1_ps(1e-3f); for (int k = 0; k < G / 8; k++) Q6B[w][k].d = _mm512_set1_ps(1e-3f); }
    char *x = (char *)X;
    for (size_t i = 0; i < sizeof X; i++) x[i] = rand() % 255 - 127;
    for (int i = 0; i < M / 8 * G * 8; i++) ((float *)XD)[i] = ((float *)XS)[i] = 0.01f;
    for (int i = 0; i < M / 8 * G; i++) ((float *)XD8)[i] = 0.01f;
}

int main(void) {
    fill();
    void (*fns[5])(void) = {cur, q8k_dpwssd, q8k_mulld, q6cur, q6q8k};
    const char *names[5] = {"q4k_app", "q4k_q8k_dpwssd", "q4k_q8k_mulld", "q6k_app", "q6k_q8k"};
    const double macs = (double)M * 32 * G * 32;
    for (int rep = 0; rep < 3; rep++)
        for (int f = 0; f < 5; f++) {
            double best = 1e9;
            for (int it = 0; it < 200; it++) { double t = now(); fns[f](); double e = now() - t; if (e < best) best = e; }
            printf("%s\t%.1f\n", names[f], macs / best / 1e9);
        }
    return 0;
}
