/* This CPU's arithmetic peaks, the yardstick `localbatch bench kernels` holds the GEMMs to: loops of
 * independent multiply-accumulate chains (more chains than the instruction's latency times its
 * throughput, so none waits on its own result) and nothing else.
 *   int8, AVX-512 VNNI: vpdpbusd on zmm, 64 u8 x s8 products summed into int32 an instruction;
 *   int8, AVX2: two vpmaddubsw summed as int16, vpmaddwd with ones to int32, and an add (what the
 *        AVX2 tiles do per 64 products; the unsigned operand must then stay small, as the tiles' do);
 *   fp32: vfmadd on zmm where the CPU has AVX-512F, else on ymm.
 * Which one runs follows the GEMM tiles' choice (qgemm_isa, cpu_qgemm.c): only what the CPU
 * confirmed. Each returns the multiply-accumulates it did, the caller times it. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#define CHAINS 12 /* vpdpbusd: latency 5, up to 2 a cycle; FMA: 4, 2 a cycle */

int qgemm_isa(void); /* cpu_qgemm.c: 1 where the tiles run AVX-512 VNNI */

/* Keeps the compiler from folding the loop: it cannot see v's value. */
#define OPAQUE(v) __asm__ volatile("" : "+x"(v))

static int64_t int8_avx2(int64_t iters) {
    /* Four chains suffice (the add is the only dependency); each has an input of its own, made opaque
     * every round, so that no product is computed once and reused. */
    __m256i acc[4], a[4], b = _mm256_set1_epi8(-2), ones = _mm256_set1_epi16(1);
    for (int c = 0; c < 4; c++) acc[c] = _mm256_set1_epi32(c), a[c] = _mm256_set1_epi8((char)(3 + c));
    for (int64_t i = 0; i < iters * (CHAINS / 4); i++)
        for (int c = 0; c < 4; c++) {
            OPAQUE(a[c]);
            __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(a[c], b), _mm256_maddubs_epi16(b, a[c]));
            acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(p, ones));
        }
    int32_t out[8];
    _mm256_storeu_si256((__m256i *)out, _mm256_add_epi32(_mm256_add_epi32(acc[0], acc[1]), _mm256_add_epi32(acc[2], acc[3])));
    return out[0] == 42 ? 0 : iters * CHAINS * 64;
}

/* Written out (intrinsics on an array of accumulators had gcc store all twelve every round): each
 * round is the twelve instructions alone, the accumulators in twelve registers of their own. */
#define CHAIN_ASM(op)                                                                                    \
    __asm__ volatile(op " %[b], %[a], %[c0]\n\t" op " %[b], %[a], %[c1]\n\t" op " %[b], %[a], %[c2]\n\t"       \
                     op " %[b], %[a], %[c3]\n\t" op " %[b], %[a], %[c4]\n\t" op " %[b], %[a], %[c5]\n\t"       \
                     op " %[b], %[a], %[c6]\n\t" op " %[b], %[a], %[c7]\n\t" op " %[b], %[a], %[c8]\n\t"       \
                     op " %[b], %[a], %[c9]\n\t" op " %[b], %[a], %[c10]\n\t" op " %[b], %[a], %[c11]"           \
                     : [c0] "+v"(c0), [c1] "+v"(c1), [c2] "+v"(c2), [c3] "+v"(c3), [c4] "+v"(c4), [c5] "+v"(c5),  \
                       [c6] "+v"(c6), [c7] "+v"(c7), [c8] "+v"(c8), [c9] "+v"(c9), [c10] "+v"(c10),             \
                       [c11] "+v"(c11)                                                                    \
                     : [a] "v"(a), [b] "v"(b))
#define SUM12(add) add(add(add(add(c0, c1), add(c2, c3)), add(add(c4, c5), add(c6, c7))), add(add(c8, c9), add(c10, c11)))

static int64_t fp32_avx2(int64_t iters) {
    __m256 a = _mm256_set1_ps(1.0f), b = _mm256_set1_ps(1e-7f), c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11;
    c0 = c1 = c2 = c3 = c4 = c5 = c6 = c7 = c8 = c9 = c10 = c11 = _mm256_setzero_ps();
    for (int64_t i = 0; i < iters; i++) CHAIN_ASM("vfmadd231ps");
    float out[8];
    _mm256_storeu_ps(out, SUM12(_mm256_add_ps));
    return out[0] == 42.5f ? 0 : iters * CHAINS * 8;
}

/* Only the two functions below hold AVX-512 instructions; they run only where qgemm_isa says so. */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512vnni")
__attribute__((noinline)) static int64_t int8_peak_vnni(int64_t iters) {
    __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2), c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11;
    c0 = c1 = c2 = c3 = c4 = c5 = c6 = c7 = c8 = c9 = c10 = c11 = _mm512_setzero_si512();
    for (int64_t i = 0; i < iters; i++) CHAIN_ASM("vpdpbusd");
    return _mm512_reduce_add_epi32(SUM12(_mm512_add_epi32)) == 42 ? 0 : iters * CHAINS * 64;
}

__attribute__((noinline)) static int64_t fp32_peak_vnni(int64_t iters) {
    __m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(1e-7f), c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11;
    c0 = c1 = c2 = c3 = c4 = c5 = c6 = c7 = c8 = c9 = c10 = c11 = _mm512_setzero_ps();
    for (int64_t i = 0; i < iters; i++) CHAIN_ASM("vfmadd231ps");
    return _mm512_reduce_add_ps(SUM12(_mm512_add_ps)) == 42.5f ? 0 : iters * CHAINS * 16;
}
#pragma GCC pop_options

/* `iters` rounds of the chains on each of `nthreads` threads (kind 0: int8, 1: fp32), with the
 * instruction set the GEMM tiles run; returns the multiply-accumulates done in all. */
int64_t qpeak(int kind, int64_t iters, int nthreads) {
    const int vnni = qgemm_isa() == 1;
    int64_t total = 0;
#pragma omp parallel num_threads(nthreads) reduction(+ : total)
    {
        if (kind == 0)
            total += vnni ? int8_peak_vnni(iters) : int8_avx2(iters);
        else
            total += vnni ? fp32_peak_vnni(iters) : fp32_avx2(iters);
    }
    return total;
}

/* The memory's read rate, the floor a decode step's weight stream is held to: each of `nthreads`
 * threads reads its share of `buf` (whole 256-byte steps; what is left over is not read) as two
 * streams, each asked for PEAK_PREFETCH bytes ahead, the way the decode kernels walk a pair of
 * tiles, and nothing but an add a load: plain loads can read markedly slower (docs/benchmarks.md).
 * Returns a checksum of the bytes, so that no load can be dropped. */
#define PEAK_PREFETCH 1024

int64_t read_pass(const char *buf, int64_t bytes, int nthreads) {
    int64_t total = 0;
#pragma omp parallel num_threads(nthreads) reduction(+ : total)
    {
        const int64_t share = bytes / omp_get_num_threads() / 256 * 256, half = share / 2;
        const char *a = buf + share * omp_get_thread_num(), *b = a + half;
        __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
        for (int64_t i = 0; i < half; i += 64) {
            _mm_prefetch(a + i + PEAK_PREFETCH, _MM_HINT_T0);
            _mm_prefetch(b + i + PEAK_PREFETCH, _MM_HINT_T0);
            s0 = _mm256_add_epi8(s0, _mm256_load_si256((const __m256i *)(a + i)));
            s1 = _mm256_add_epi8(s1, _mm256_load_si256((const __m256i *)(a + i + 32)));
            s2 = _mm256_add_epi8(s2, _mm256_load_si256((const __m256i *)(b + i)));
            s3 = _mm256_add_epi8(s3, _mm256_load_si256((const __m256i *)(b + i + 32)));
        }
        uint8_t out[32];
        _mm256_storeu_si256((__m256i *)out, _mm256_add_epi8(_mm256_add_epi8(s0, s1), _mm256_add_epi8(s2, s3)));
        for (int k = 0; k < 32; k++) total += out[k];
    }
    return total;
}
