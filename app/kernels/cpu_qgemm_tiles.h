/* The tile kernels of cpu_qgemm.c, included there once per instruction set: QG(name) names this
 * copy's functions, QG_VNNI picks how a group's integer dot is summed:
 *   0 (AVX2): maddubs (u8 x s8 -> pairs summed into int16) and madd with ones (-> int32);
 *   1 (AVX-512 VNNI): vpdpbusd, u8 x s8 summed four at a time straight into int32.
 * Either way the dot is exact, and the float operations after it are the same in the same order,
 * so both copies, and the fused and split kernels below, produce the same bits. */

#define QG_FUSED_ROWS 4 /* up to this many rows (decode, a short verify): the fused kernels */
#define QG_FEW_ROWS 6   /* a whole GEMM of 5 or 6 rows (a 4-token verify): the few-row kernels */
#define QG_CHUNK 16     /* groups whose integer dots the split kernels keep before scaling them */

/* Four activation levels (k .. k+3 of a row) broadcast to every lane, for vector s of a group:
 * with many rows one broadcast load each (a load port, no shuffle); a row or two load their 32
 * levels as two 16-byte halves and shuffle the pieces out (faster at one row, where the weights'
 * stream is what counts). */
#ifndef QG_ROW_DEFINED
#define QG_ROW_DEFINED
typedef struct {
    const int8_t *x;
    __m256i lo, hi;
} qg_row;
#endif

ALWAYS_INLINE qg_row QG(row_at)(const int8_t *x, const int R) {
    qg_row q = {x, _mm256_setzero_si256(), _mm256_setzero_si256()};
    if (R <= 2) {
        q.lo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)x));
        q.hi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(x + 16)));
    }
    return q;
}

/* Levels 4s .. 4s+3 (half 0) or 16+4s .. 16+4s+3 (half 1) of the row. */
ALWAYS_INLINE __m256i QG(piece)(const qg_row *q, const int half, const int s, const int R) {
    if (R > 2)
        return bcast4(q->x + 16 * half + 4 * s);
    const __m256i v = half ? q->hi : q->lo;
    switch (s) {
    case 0: return _mm256_shuffle_epi32(v, 0x00);
    case 1: return _mm256_shuffle_epi32(v, 0x55);
    case 2: return _mm256_shuffle_epi32(v, 0xAA);
    default: return _mm256_shuffle_epi32(v, 0xFF);
    }
}

/* q4 / q5: a group's 128 bytes of nibbles are 4 vectors; in vector s, lane j holds row j's levels
 * 4s .. 4s+3 in its low nibbles and 16+4s .. 16+4s+3 in its high ones. q5 adds a group's 32 bytes
 * of 5th bits (fifth_bits). A group's weights are unpacked into registers once for the R rows. */
ALWAYS_INLINE void QG(q4_unpack)(const uint8_t *w, const uint8_t *qh, const int q5, __m256i lo[4], __m256i hi[4]) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    prefetch_ahead(w, TILE * 16);
    if (q5)
        prefetch_ahead(qh, 32);
    const __m256i h = q5 ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
    for (int s = 0; s < 4; s++) {
        __m256i b = _mm256_loadu_si256((const __m256i *)(w + s * 32));
        lo[s] = _mm256_and_si256(b, mask), hi[s] = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
        if (q5) {
            lo[s] = _mm256_or_si256(lo[s], fifth_bits(h, 2 * s));
            hi[s] = _mm256_or_si256(hi[s], fifth_bits(h, 2 * s + 1));
        }
    }
}

/* One row's dot with an unpacked q4 / q5 group, lane j: weight row j. AVX2's int16 sums stay below
 * 8 * 2 * 15 * 127 = 30480 (q4) and 4 * 2 * 31 * 127 = 31496 (q5, widened after the second
 * vector): exact. */
ALWAYS_INLINE __m256i QG(q4_dot)(const __m256i lo[4], const __m256i hi[4], const int8_t *x, const int R, const int q5) {
    const qg_row q = QG(row_at)(x, R);
#if QG_VNNI
    (void)q5;
    __m256i dot = _mm256_setzero_si256();
    for (int s = 0; s < 4; s++) {
        dot = _mm256_dpbusd_epi32(dot, lo[s], QG(piece)(&q, 0, s, R));
        dot = _mm256_dpbusd_epi32(dot, hi[s], QG(piece)(&q, 1, s, R));
    }
    return dot;
#else
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i p = _mm256_setzero_si256(), dot = _mm256_setzero_si256();
    for (int s = 0; s < 4; s++) {
        if (q5 && s == 2) {
            dot = _mm256_madd_epi16(p, ones);
            p = _mm256_setzero_si256();
        }
        p = _mm256_add_epi16(p, _mm256_add_epi16(_mm256_maddubs_epi16(lo[s], QG(piece)(&q, 0, s, R)),
                                                 _mm256_maddubs_epi16(hi[s], QG(piece)(&q, 1, s, R))));
    }
    return _mm256_add_epi32(dot, _mm256_madd_epi16(p, ones));
#endif
}

/* q6 (a Q6_K tensor at its own bits): a group's 192 bytes are q4's 128 bytes of nibbles (the levels'
 * low four bits) and two vectors of their top two bits: in vector s / 2, byte 4j+b holds in bits
 * 2k, 2k+1 (k = 2 (s % 2) + p) the top bits of row j's level 16p+4s+b. Levels 0..63; the weight is
 * d * sc[half] * (level - 32), an int8 sub-scale per 16 levels (`a->sc`: [tiles][G][8 rows][2]). */
ALWAYS_INLINE void QG(q6_unpack)(const uint8_t *w, __m256i lo[4], __m256i hi[4]) {
    const __m256i mask = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
    prefetch_ahead(w, TILE * 24);
    for (int s = 0; s < 4; s++) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)(w + s * 32));
        const __m256i h = _mm256_loadu_si256((const __m256i *)(w + 128 + (s / 2) * 32));
        /* to bits 4, 5: field k = 0, 1, 2, 3 moves left 4, left 2, not at all, right 2 (16-bit
         * shifts: what crosses into the next byte is masked off) */
        const __m256i hl = s % 2 == 0 ? _mm256_slli_epi16(h, 4) : h;
        const __m256i hh = s % 2 == 0 ? _mm256_slli_epi16(h, 2) : _mm256_srli_epi16(h, 2);
        lo[s] = _mm256_or_si256(_mm256_and_si256(b, mask), _mm256_and_si256(hl, top));
        hi[s] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), mask), _mm256_and_si256(hh, top));
    }
}

/* One row's dot with an unpacked q6 group: per half, sc * sum(level * x) - 32 * sc * sum(x) (the
 * half sums come with the activations). The int16 sums of two maddubs stay below 2 * 2 * 63 *
 * 127 = 32004: exact. `scp`: lane j = row j's (sc_lo, sc_hi) as int16. */
ALWAYS_INLINE __m256i QG(q6_dot)(const __m256i lo[4], const __m256i hi[4], const __m256i scp, const int8_t *x,
                                 const int32_t halves, const int R) {
    const qg_row q = QG(row_at)(x, R);
    const __m256i sclo = _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(scp, 0xA0), 0xA0);
    const __m256i schi = _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(scp, 0xF5), 0xF5);
    __m256i dot = _mm256_setzero_si256();
    for (int s = 0; s < 4; s += 2) {
        const __m256i pl = _mm256_add_epi16(_mm256_maddubs_epi16(lo[s], QG(piece)(&q, 0, s, R)),
                                            _mm256_maddubs_epi16(lo[s + 1], QG(piece)(&q, 0, s + 1, R)));
        const __m256i ph = _mm256_add_epi16(_mm256_maddubs_epi16(hi[s], QG(piece)(&q, 1, s, R)),
                                            _mm256_maddubs_epi16(hi[s + 1], QG(piece)(&q, 1, s + 1, R)));
        dot = _mm256_add_epi32(dot, _mm256_add_epi32(_mm256_madd_epi16(pl, sclo), _mm256_madd_epi16(ph, schi)));
    }
    const __m256i offset = _mm256_madd_epi16(scp, _mm256_set1_epi32(halves));
    return _mm256_sub_epi32(dot, _mm256_slli_epi32(offset, 5));
}

/* q8: a group's 256 bytes are 8 vectors; in vector s, lane j holds row j's levels 4s .. 4s+3.
 * Signed times signed: maddubs / vpdpbusd want one operand unsigned, so |w| times x with w's signs
 * (|w| is shared by the R rows). AVX2's int16 pair sums stay below 2 * 127 * 127: exact. All R
 * rows' dots of one group at once: each weight vector is loaded once. */
ALWAYS_INLINE void QG(q8_dots)(const int8_t *w, const int8_t *x, const int R, __m256i *dots) {
    prefetch_ahead(w, TILE * 32);
    for (int i = 0; i < R; i++) dots[i] = _mm256_setzero_si256();
    for (int s = 0; s < 8; s++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(w + s * 32)), av = _mm256_sign_epi8(v, v);
        for (int i = 0; i < R; i++) {
            __m256i sx = _mm256_sign_epi8(bcast4(x + 32 * i + 4 * s), v);
#if QG_VNNI
            dots[i] = _mm256_dpbusd_epi32(dots[i], av, sx);
#else
            dots[i] = _mm256_add_epi32(dots[i], _mm256_madd_epi16(_mm256_maddubs_epi16(av, sx), _mm256_set1_epi16(1)));
#endif
        }
    }
}

/* A group's weight scales d[n, g] and minimums m[n, g] for a tile's 8 rows: fp16 per group (q6's d
 * per block of 8 groups); q4k: an fp16 per block of 8 groups times the group's 0..63 scale and min;
 * q4_0 / q5_0: m = -8 d / -16 d. Every product is exact in fp32. */
ALWAYS_INLINE void QG(group_scales)(const int fmt, const uint16_t *dt, const uint16_t *mt, const int8_t *sct,
                                    const int64_t g, __m256 *dv, __m256 *mv) {
    if (fmt == QG_Q4K) {
        const __m128i sm = _mm_loadu_si128((const __m128i *)(sct + g * 16)); /* 8 scales, then 8 mins */
        *dv = _mm256_mul_ps(load_ph(dt + (g >> 3) * TILE), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm)));
        *mv = _mm256_mul_ps(load_ph(mt + (g >> 3) * TILE),
                            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))));
        return;
    }
    *dv = load_ph(dt + (fmt == QG_Q6 ? g >> 3 : g) * TILE);
    if (fmt == QG_Q4_0 || fmt == QG_Q5_0)
        *mv = _mm256_mul_ps(*dv, _mm256_set1_ps(fmt == QG_Q4_0 ? -8.0f : -16.0f));
    else
        *mv = mt ? load_ph(mt + g * TILE) : _mm256_setzero_ps();
}

/* Every output y[r, n] is, over the groups g in order,
 *     acc = fma(d[n, g] * xd[r, g], (float)dot(w[n, g], x[r, g]), acc)    (scale_dots)
 *     mac = fma(m[n, g], xs[r, g], mac)            (sum_mins: all but q8 and q6, with minimums)
 * and then acc + mac, in lane n % 8 of a tile. scale_group is that float half for one group of R rows. */
ALWAYS_INLINE void QG(scale_dots)(const __m256i *dots, const __m256 dv, const float *xd, const int R, __m256 *acc) {
    for (int i = 0; i < R; i++)
        acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(dv, _mm256_set1_ps(xd[i])), _mm256_cvtepi32_ps(dots[i]), acc[i]);
}

ALWAYS_INLINE void QG(sum_mins)(const __m256 mv, const float *xs, const int R, __m256 *mac) {
    for (int i = 0; i < R; i++) mac[i] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[i]), mac[i]);
}

ALWAYS_INLINE void QG(scale_group)(const __m256i *dots, const __m256 dv, const __m256 mv, const int has_m,
                                   const float *xd, const float *xs, const int R, __m256 *acc, __m256 *mac) {
    QG(scale_dots)(dots, dv, xd, R, acc);
    if (has_m)
        QG(sum_mins)(mv, xs, R, mac);
}

ALWAYS_INLINE void QG(store_tile)(const gemm_args *a, int64_t t, int64_t r, const int R, const __m256 *acc,
                                  const __m256 *mac, const int has_m) {
    for (int i = 0; i < R; i++) {
        float out[TILE];
        _mm256_storeu_ps(out, has_m ? _mm256_add_ps(acc[i], mac[i]) : acc[i]);
        for (int j = 0; j < TILE && t * TILE + j < a->N; j++) a->y[(r + i) * a->ldy + t * TILE + j] = out[j];
    }
}

/* A q4 / q5 / q6 group unpacked into lo / hi; returns q6's sub-scales (what q6_dot takes), else 0. */
ALWAYS_INLINE __m256i QG(group_unpack)(const int fmt, const void *w, const uint8_t *qh, const int8_t *sc,
                                       __m256i lo[4], __m256i hi[4]) {
    if (fmt == QG_Q6) {
        QG(q6_unpack)((const uint8_t *)w, lo, hi);
        return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
    }
    QG(q4_unpack)((const uint8_t *)w, qh, fmt == QG_Q5 || fmt == QG_Q5_0, lo, hi);
    return _mm256_setzero_si256();
}

/* One row's dot with an unpacked q4 / q5 / q6 group. */
ALWAYS_INLINE __m256i QG(row_dot)(const int fmt, const __m256i lo[4], const __m256i hi[4], const __m256i scp,
                                  const int8_t *x, const int32_t xb, const int R) {
    return fmt == QG_Q6 ? QG(q6_dot)(lo, hi, scp, x, xb, R) : QG(q4_dot)(lo, hi, x, R, fmt == QG_Q5 || fmt == QG_Q5_0);
}

/* A group's integer dots for R rows: q4 / q5 / q6 unpack the group once for all of them. */
ALWAYS_INLINE void QG(group_dots)(const int fmt, const void *w, const uint8_t *qh, const int8_t *sc, const int8_t *x,
                                  const int32_t *xb, const int R, __m256i *dots) {
    if (fmt == QG_Q8) {
        QG(q8_dots)((const int8_t *)w, x, R, dots);
        return;
    }
    __m256i lo[4], hi[4];
    const __m256i scp = QG(group_unpack)(fmt, w, qh, sc, lo, hi);
    for (int i = 0; i < R; i++) dots[i] = QG(row_dot)(fmt, lo, hi, scp, x + 32 * i, xb[i], R);
}

/* group_dots then scale_dots, each row's dot scaled into its accumulator as soon as it is summed:
 * the R accumulators and the unpacked group stay live, not R dots besides. q4 / q5 / q6 formats. */
ALWAYS_INLINE void QG(group_acc)(const int fmt, const void *w, const uint8_t *qh, const int8_t *sc, const int8_t *x,
                                 const int32_t *xb, const int R, const __m256 dv, const float *xd, __m256 *acc) {
    __m256i lo[4], hi[4];
    const __m256i scp = QG(group_unpack)(fmt, w, qh, sc, lo, hi);
    for (int i = 0; i < R; i++) {
        const __m256i dot = QG(row_dot)(fmt, lo, hi, scp, x + 32 * i, xb[i], R);
        QG(scale_dots)(&dot, dv, xd + i, 1, acc + i);
    }
}

/* Tile t against rows r .. r+R-1. A few rows: each group's dots and float sums in one pass, which
 * streams the weights fastest. Many rows (prefill): QG_CHUNK groups' integer dots first, then
 * their float sums, four rows at a time with the accumulators in registers: two short loops the
 * core overlaps, where one long one (~300 instructions a group) stalled on its own latencies. */
ALWAYS_INLINE void QG(tile_in)(const gemm_args *a, int64_t t, int64_t r, const int R, const int fmt) {
    const int64_t G = a->G, K = a->K;
    const int64_t wbytes = fmt == QG_Q8 ? TILE * 32 : fmt == QG_Q6 ? TILE * 24 : TILE * 16; /* a group's bytes */
    const char *w = (const char *)a->qs + t * G * wbytes;
    const uint8_t *qh = fmt == QG_Q5 || fmt == QG_Q5_0 ? a->qh + t * G * 32 : NULL;
    const int blocked = fmt == QG_Q6 || fmt == QG_Q4K, has_m = fmt != QG_Q8 && fmt != QG_Q6;
    const int64_t GS = blocked ? G >> 3 : G; /* scale entries a tile: q6 and q4k per block of 8 groups */
    const int stored_m = fmt == QG_Q4 || fmt == QG_Q5 || fmt == QG_Q4K;
    const uint16_t *dt = a->d + t * GS * TILE, *mt = stored_m ? a->m + t * GS * TILE : NULL;
    const int8_t *sc = blocked ? a->sc + t * G * 16 : NULL;
    const int8_t *xg = a->xq + x_at(r, K);
    const float *xd = a->xd + tab_at(r, G), *xs = a->xs + tab_at(r, G);
    const int32_t *xb = a->xb + tab_at(r, G);
    __m256 acc[R], mac[R];
    for (int i = 0; i < R; i++) acc[i] = mac[i] = _mm256_setzero_ps();
    if (R > QG_FUSED_ROWS && a->M <= QG_FEW_ROWS && fmt != QG_Q8) {
        /* 5 or 6 rows in all: one pass over the weights as the fused kernels take, then the
         * minimums' sums in a second over the scales, so the rows' accumulators stay in registers.
         * The split kernels below cost 8 rows' time at 5; at 7 and 8 they are as fast or faster. */
        for (int64_t g = 0; g < G; g++) {
            __m256 dv, mv;
            QG(group_scales)(fmt, dt, mt, sc, g, &dv, &mv);
            QG(group_acc)(fmt, w + g * wbytes, qh ? qh + g * 32 : NULL, sc ? sc + g * 16 : NULL, xg + g * 32 * TILE,
                          xb + g * TILE, R, dv, xd + g * TILE, acc);
        }
        for (int64_t g = 0; has_m && g < G; g++) {
            __m256 dv, mv;
            QG(group_scales)(fmt, dt, mt, sc, g, &dv, &mv);
            QG(sum_mins)(mv, xs + g * TILE, R, mac);
        }
    } else if (R <= QG_FUSED_ROWS) {
        for (int64_t g = 0; g < G; g++) {
            __m256i dots[R];
            __m256 dv, mv;
            QG(group_dots)(fmt, w + g * wbytes, qh ? qh + g * 32 : NULL, sc ? sc + g * 16 : NULL, xg + g * 32 * TILE,
                           xb + g * TILE, R, dots);
            QG(group_scales)(fmt, dt, mt, sc, g, &dv, &mv);
            QG(scale_group)(dots, dv, mv, has_m, xd + g * TILE, xs + g * TILE, R, acc, mac);
        }
    } else {
        __m256i dots[QG_CHUNK][R];
        __m256 dvs[QG_CHUNK], mvs[QG_CHUNK];
        for (int64_t g0 = 0; g0 < G; g0 += QG_CHUNK) {
            const int gn = G - g0 < QG_CHUNK ? (int)(G - g0) : QG_CHUNK;
            for (int c = 0; c < gn; c++) {
                const int64_t g = g0 + c;
                QG(group_dots)(fmt, w + g * wbytes, qh ? qh + g * 32 : NULL, sc ? sc + g * 16 : NULL,
                               xg + g * 32 * TILE, xb + g * TILE, R, dots[c]);
                QG(group_scales)(fmt, dt, mt, sc, g, &dvs[c], &mvs[c]);
            }
            for (int i0 = 0; i0 < R; i0 += 4) {
                const int n = R - i0 < 4 ? R - i0 : 4;
                for (int c = 0; c < gn; c++) {
                    const int64_t g = g0 + c;
                    QG(scale_group)(dots[c] + i0, dvs[c], mvs[c], has_m, xd + g * TILE + i0, xs + g * TILE + i0, n,
                                    acc + i0, mac + i0);
                }
            }
        }
    }
    QG(store_tile)(a, t, r, R, acc, mac, has_m);
}

/* Tile t against rows r .. r+R-1, in the matrix's format (a branch per tile, not per group). */
ALWAYS_INLINE void QG(tile)(const gemm_args *a, int64_t t, int64_t r, const int R) {
    switch (a->fmt) {
    case QG_Q6: QG(tile_in)(a, t, r, R, QG_Q6); break;
    case QG_Q5: QG(tile_in)(a, t, r, R, QG_Q5); break;
    case QG_Q4: QG(tile_in)(a, t, r, R, QG_Q4); break;
    case QG_Q4K: QG(tile_in)(a, t, r, R, QG_Q4K); break;
    case QG_Q4_0: QG(tile_in)(a, t, r, R, QG_Q4_0); break;
    case QG_Q5_0: QG(tile_in)(a, t, r, R, QG_Q5_0); break;
    default: QG(tile_in)(a, t, r, R, QG_Q8);
    }
}

/* Tile t against rows r .. end-1, eight at a time, then the rest in one pass: a tile's unpacking
 * is paid once for them (a verify step's 1 + k rows are rarely a power of two). */
static void QG(tile_rows)(const gemm_args *a, int64_t t, int64_t r, int64_t end) {
    for (; r + 8 <= end; r += 8) QG(tile)(a, t, r, 8);
    switch (end - r) {
    case 7: QG(tile)(a, t, r, 7); break;
    case 6: QG(tile)(a, t, r, 6); break;
    case 5: QG(tile)(a, t, r, 5); break;
    case 4: QG(tile)(a, t, r, 4); break;
    case 3: QG(tile)(a, t, r, 3); break;
    case 2: QG(tile)(a, t, r, 2); break;
    case 1: QG(tile)(a, t, r, 1); break;
    }
}

#if QG_VNNI
/* Every row count on AVX-512 VNNI: two tiles side by side in one zmm register (lanes 0-7 tile t's
 * rows, 8-15 tile t+span's: t+1 in a panel, half a thread's tiles on in run_gemm's pairs, so that
 * each of the two weight streams runs on from one pair to the next) against up to 16 activation
 * rows, vpdpbusd on 16 weight rows at once. Each lane runs the float operations a tile's lane
 * runs above, in the same order (the integer dots are exact), so the outputs are the same bits;
 * only the instruction count per product halves. */
#define QG_PAIR_ROWS 8

/* Vector s of a group for tiles t (at p) and t+span (at p + next). */
ALWAYS_INLINE __m512i QG(pair_load)(const void *p, const int64_t next) {
    const char *c = (const char *)p;
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)c)),
                              _mm256_loadu_si256((const __m256i *)(c + next)), 1);
}

ALWAYS_INLINE __m512 QG(pair_ph)(const uint16_t *p, const int64_t next) {
    const __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)),
                                              _mm_loadu_si128((const __m128i *)(p + next)), 1);
    return _mm512_cvtph_ps(h);
}

ALWAYS_INLINE __m512i QG(fifth_bits2)(__m512i h, const int k) {
    if (k < 4)
        h = _mm512_slli_epi16(h, 4 - k);
    else if (k > 4)
        h = _mm512_srli_epi16(h, k - 4);
    return _mm512_and_si512(h, _mm512_set1_epi8(0x10));
}

/* A group of both tiles unpacked to unsigned bytes: q4 / q5 / q6 levels as above, q8's levels
 * + 128 (vpdpbusd wants one operand unsigned; the dot then starts at -128 * the activations' sum). */
ALWAYS_INLINE void QG(pair_unpack)(const int fmt, const char *w, const int64_t wnext, const uint8_t *qh,
                                   const int64_t hnext, __m512i v[8]) {
    const __m512i mask = _mm512_set1_epi8(0x0F);
    if (fmt == QG_Q8) {
        prefetch_ahead(w, TILE * 32);
        prefetch_ahead(w + wnext, TILE * 32);
        for (int s = 0; s < 8; s++)
            v[s] = _mm512_xor_si512(QG(pair_load)(w + s * 32, wnext), _mm512_set1_epi8((char)0x80));
        return;
    }
    if (fmt == QG_Q6) {
        const __m512i top = _mm512_set1_epi8(0x30);
        prefetch_ahead(w, TILE * 24);
        prefetch_ahead(w + wnext, TILE * 24);
        for (int s = 0; s < 4; s++) {
            const __m512i b = QG(pair_load)(w + s * 32, wnext), h = QG(pair_load)(w + 128 + (s / 2) * 32, wnext);
            const __m512i hl = s % 2 == 0 ? _mm512_slli_epi16(h, 4) : h;
            const __m512i hh = s % 2 == 0 ? _mm512_slli_epi16(h, 2) : _mm512_srli_epi16(h, 2);
            v[s] = _mm512_or_si512(_mm512_and_si512(b, mask), _mm512_and_si512(hl, top));
            v[4 + s] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(b, 4), mask), _mm512_and_si512(hh, top));
        }
        return;
    }
    const int q5 = fmt == QG_Q5 || fmt == QG_Q5_0;
    prefetch_ahead(w, TILE * 16);
    prefetch_ahead(w + wnext, TILE * 16);
    const __m512i h = q5 ? QG(pair_load)(qh, hnext) : _mm512_setzero_si512();
    for (int s = 0; s < 4; s++) {
        const __m512i b = QG(pair_load)(w + s * 32, wnext);
        v[s] = _mm512_and_si512(b, mask), v[4 + s] = _mm512_and_si512(_mm512_srli_epi16(b, 4), mask);
        if (q5) {
            v[s] = _mm512_or_si512(v[s], QG(fifth_bits2)(h, 2 * s));
            v[4 + s] = _mm512_or_si512(v[4 + s], QG(fifth_bits2)(h, 2 * s + 1));
        }
    }
}

/* One activation row's exact integer dot with both tiles' unpacked group, as fp32 (`xb`: its
 * halves' level sums; `sclo`, `schi`: q6's sub-scales of each half, as fp32). q6's halves start
 * at -32 x their level sums and their scaled sum is one fma of exact products (see panel_group). */
ALWAYS_INLINE __m512 QG(pair_dot)(const int fmt, const __m512i v[8], const int8_t *x, const int32_t xb,
                                  const __m512 sclo, const __m512 schi) {
    if (fmt == QG_Q8) {
        __m512i dot = _mm512_set1_epi32(-128 * ((int32_t)(int16_t)xb + (xb >> 16)));
        for (int s = 0; s < 8; s++) dot = _mm512_dpbusd_epi32(dot, v[s], _mm512_set1_epi32(*(const int32_t *)(x + 4 * s)));
        return _mm512_cvtepi32_ps(dot);
    }
    if (fmt != QG_Q6) { /* one chain: the rows' chains overlap, and no add joins two */
        __m512i dot = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++)
            dot = _mm512_dpbusd_epi32(dot, v[s], _mm512_set1_epi32(*(const int32_t *)(x + 16 * (s / 4) + 4 * (s % 4))));
        return _mm512_cvtepi32_ps(dot);
    }
    __m512i lo = _mm512_set1_epi32(-32 * (int32_t)(int16_t)xb), hi = _mm512_set1_epi32(-32 * (xb >> 16));
    for (int s = 0; s < 4; s++) {
        lo = _mm512_dpbusd_epi32(lo, v[s], _mm512_set1_epi32(*(const int32_t *)(x + 4 * s)));
        hi = _mm512_dpbusd_epi32(hi, v[4 + s], _mm512_set1_epi32(*(const int32_t *)(x + 16 + 4 * s)));
    }
    return _mm512_fmadd_ps(sclo, _mm512_cvtepi32_ps(lo), _mm512_mul_ps(schi, _mm512_cvtepi32_ps(hi)));
}

/* q6's sub-scales of group g of tiles t (at sc) and t+span (at sc + snext), each half's as fp32. */
ALWAYS_INLINE void QG(pair_subscales)(const int8_t *sc, const int64_t snext, const int64_t g, __m512 *sclo, __m512 *schi) {
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(sc + g * 16))),
                                                 _mm_loadu_si128((const __m128i *)(sc + snext + g * 16)), 1);
    const __m512i scp = _mm512_cvtepi8_epi16(both); /* lane j: (sc_lo, sc_hi) int16 */
    *sclo = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(scp, 16), 16));
    *schi = _mm512_cvtepi32_ps(_mm512_srai_epi32(scp, 16));
}

/* q4k's and q6's d (and q4k's m) of the block of 8 groups that holds group g, both tiles, as fp32. */
ALWAYS_INLINE void QG(pair_block_d)(const int fmt, const uint16_t *dt, const uint16_t *mt, const int64_t dnext,
                                    const int64_t g, __m512 *dblk, __m512 *mblk) {
    *dblk = QG(pair_ph)(dt + (g >> 3) * TILE, dnext);
    *mblk = fmt == QG_Q4K ? QG(pair_ph)(mt + (g >> 3) * TILE, dnext) : _mm512_setzero_ps();
}

/* pair_scales' q4k and q6 numbers from their block's d and m (pair_block_d). */
ALWAYS_INLINE void QG(pair_block_scales)(const int fmt, const __m512 dblk, const __m512 mblk, const int8_t *sct,
                                         const int64_t snext, const int64_t g, __m512 *dv, __m512 *mv) {
    *dv = dblk, *mv = _mm512_setzero_ps();
    if (fmt == QG_Q4K) {
        const __m128i a = _mm_loadu_si128((const __m128i *)(sct + g * 16)), b = _mm_loadu_si128((const __m128i *)(sct + snext + g * 16));
        *dv = _mm512_mul_ps(dblk, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(a, b))));
        *mv = _mm512_mul_ps(mblk, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi64(a, b))));
    }
}

/* A group's d (and m) for both tiles, as group_scales makes them for each. The caller walks g from
 * 0 in order and keeps `blk` (q4k's and q6's block d and m) between calls: converted once a block. */
ALWAYS_INLINE void QG(pair_scales)(const int fmt, const uint16_t *dt, const uint16_t *mt, const int64_t dnext,
                                   const int8_t *sct, const int64_t snext, const int64_t g, __m512 blk[2], __m512 *dv,
                                   __m512 *mv) {
    if (fmt == QG_Q4K || fmt == QG_Q6) {
        if ((g & 7) == 0)
            QG(pair_block_d)(fmt, dt, mt, dnext, g, &blk[0], &blk[1]);
        QG(pair_block_scales)(fmt, blk[0], blk[1], sct, snext, g, dv, mv);
        return;
    }
    *dv = QG(pair_ph)(dt + g * TILE, dnext);
    if (fmt == QG_Q4_0 || fmt == QG_Q5_0)
        *mv = _mm512_mul_ps(*dv, _mm512_set1_ps(fmt == QG_Q4_0 ? -8.0f : -16.0f));
    else
        *mv = mt ? QG(pair_ph)(mt + g * TILE, dnext) : _mm512_setzero_ps();
}

/* Tiles t and t+span against rows r .. r+R-1 (R: 1-8 or 16; at 16 the unpacking is paid once for
 * twice the rows, the accumulators and the unpacked group still in registers). */
ALWAYS_INLINE void QG(pair_in)(const gemm_args *a, int64_t t, const int64_t span, int64_t r, const int R, const int fmt) {
    const int64_t G = a->G, K = a->K;
    const int64_t wbytes = fmt == QG_Q8 ? TILE * 32 : fmt == QG_Q6 ? TILE * 24 : TILE * 16;
    const int64_t wtile = G * wbytes, wnext = span * wtile;
    const char *w = (const char *)a->qs + t * wtile;
    const uint8_t *qh = fmt == QG_Q5 || fmt == QG_Q5_0 ? a->qh + t * G * 32 : NULL;
    const int blocked = fmt == QG_Q6 || fmt == QG_Q4K, has_m = fmt != QG_Q8 && fmt != QG_Q6;
    const int64_t GS = blocked ? G >> 3 : G, dnext = span * GS * TILE;
    const int stored_m = fmt == QG_Q4 || fmt == QG_Q5 || fmt == QG_Q4K;
    const uint16_t *dt = a->d + t * GS * TILE, *mt = stored_m ? a->m + t * GS * TILE : NULL;
    const int8_t *sc = blocked ? a->sc + t * G * 16 : NULL;
    /* rows come in blocks of 8 (x_at): row i of the 16 is block i / 8's row i % 8 */
    const int8_t *xg = a->xq + x_at(r, K);
    const float *xd = a->xd + tab_at(r, G), *xs = a->xs + tab_at(r, G);
    const int32_t *xb = a->xb + tab_at(r, G);
    const int64_t xblock = K * TILE, tblock = G * TILE;
    __m512 acc[R], mac[R];
#pragma GCC unroll 16
    for (int i = 0; i < R; i++) acc[i] = mac[i] = _mm512_setzero_ps();
    /* up to 8 rows the minimums' sums run in the same loop (their scales made once); 16 rows' acc
     * and mac would not all stay in registers */
    const int fused_m = has_m && R <= QG_PAIR_ROWS;
    __m512 blk[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}; /* pair_scales' block d and m */
    for (int64_t g = 0; g < G; g++) {
        __m512i v[8];
        __m512 sclo = _mm512_setzero_ps(), schi = sclo;
        QG(pair_unpack)(fmt, w + g * wbytes, wnext, qh ? qh + g * 32 : NULL, span * G * 32, v);
        if (fmt == QG_Q6)
            QG(pair_subscales)(sc, span * G * 16, g, &sclo, &schi);
        __m512 dv, mv;
        QG(pair_scales)(fmt, dt, mt, dnext, sc, span * G * 16, g, blk, &dv, &mv);
#pragma GCC unroll 16
        for (int i = 0; i < R; i++) {
            const int64_t xo = i / TILE * xblock + g * 32 * TILE + 32 * (i % TILE), to = i / TILE * tblock + g * TILE + i % TILE;
            const __m512 dot = QG(pair_dot)(fmt, v, xg + xo, xb[to], sclo, schi);
            acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(dv, _mm512_set1_ps(xd[to])), dot, acc[i]);
            if (fused_m)
                mac[i] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[to]), mac[i]);
        }
    }
    for (int64_t g = 0; has_m && !fused_m && g < G; g++) {
        __m512 dv, mv;
        QG(pair_scales)(fmt, dt, mt, dnext, sc, span * G * 16, g, blk, &dv, &mv);
#pragma GCC unroll 16
        for (int i = 0; i < R; i++) mac[i] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[i / TILE * tblock + g * TILE + i % TILE]), mac[i]);
    }
    /* tile t is whole (a tile follows it); t+span may be the matrix's last, partial one */
    const int64_t u = (t + span) * TILE, cols = a->N - u < TILE ? a->N - u : TILE;
    for (int i = 0; i < R; i++) {
        const __m512 out = has_m ? _mm512_add_ps(acc[i], mac[i]) : acc[i];
        float *yr = a->y + (r + i) * a->ldy;
        _mm256_storeu_ps(yr + t * TILE, _mm512_castps512_ps256(out));
        _mm256_mask_storeu_ps(yr + u, (__mmask8)((1u << cols) - 1), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(out), 1)));
    }
}

/* Tiles t and t+span against rows r .. end-1: blocks of 16 rows, then of 8, then the rest in one pass. */
ALWAYS_INLINE void QG(pair_fmt)(const gemm_args *a, int64_t t, const int64_t span, int64_t *r, int64_t end, const int fmt) {
    for (; *r + 2 * QG_PAIR_ROWS <= end; *r += 2 * QG_PAIR_ROWS) QG(pair_in)(a, t, span, *r, 2 * QG_PAIR_ROWS, fmt);
    for (; *r + QG_PAIR_ROWS <= end; *r += QG_PAIR_ROWS) QG(pair_in)(a, t, span, *r, QG_PAIR_ROWS, fmt);
    switch (end - *r) { /* a decode step's 1-7 rows: two tiles a pass keep up with the weights' read */
    case 7: QG(pair_in)(a, t, span, *r, 7, fmt), *r = end; break;
    case 6: QG(pair_in)(a, t, span, *r, 6, fmt), *r = end; break;
    case 5: QG(pair_in)(a, t, span, *r, 5, fmt), *r = end; break;
    case 4: QG(pair_in)(a, t, span, *r, 4, fmt), *r = end; break;
    case 3: QG(pair_in)(a, t, span, *r, 3, fmt), *r = end; break;
    case 2: QG(pair_in)(a, t, span, *r, 2, fmt), *r = end; break;
    case 1: QG(pair_in)(a, t, span, *r, 1, fmt), *r = end; break;
    }
}

/* Prefill on many rows: a pair's weights unpacked once into a panel (`panel_unpack`: each group's 8
 * unpacked vectors, then its d, m and q6's sub-scales, PANEL_GROUP_BYTES a group), which then serves
 * every row of the block from L1 / L2 (`panel_in`): the unpacking, paid per 16 rows above, is paid
 * once per block of rows, and a pass spends its vector ports on vpdpbusd and the float sums alone.
 * The same integer dots and float operations in the same order as pair_in: the same bits. */
#define PANEL_V 0        /* 8 unpacked vectors */
#define PANEL_D 512      /* dv */
#define PANEL_M 576      /* mv */
#define PANEL_SCLO 640   /* q6: each half's sub-scale, as fp32 */
#define PANEL_SCHI 704
/* panel_in asks for the pass's activation levels this many groups ahead: a pass reads each of its
 * lines once, 128 of every 256 bytes, from L2, and each group's first vpdpbusd waited for them */
#define PANEL_X_AHEAD 4

ALWAYS_INLINE void QG(panel_unpack_in)(const gemm_args *a, int64_t t, char *panel, const int fmt) {
    const int64_t G = a->G;
    const int64_t wbytes = fmt == QG_Q8 ? TILE * 32 : fmt == QG_Q6 ? TILE * 24 : TILE * 16;
    const int64_t wnext = G * wbytes;
    const char *w = (const char *)a->qs + t * wnext;
    const uint8_t *qh = fmt == QG_Q5 || fmt == QG_Q5_0 ? a->qh + t * G * 32 : NULL;
    const int blocked = fmt == QG_Q6 || fmt == QG_Q4K;
    const int64_t GS = blocked ? G >> 3 : G, dnext = GS * TILE;
    const int stored_m = fmt == QG_Q4 || fmt == QG_Q5 || fmt == QG_Q4K;
    const uint16_t *dt = a->d + t * dnext, *mt = stored_m ? a->m + t * dnext : NULL;
    const int8_t *sc = blocked ? a->sc + t * G * 16 : NULL;
    __m512 blk[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}; /* pair_scales' block d and m */
    for (int64_t g = 0; g < G; g++) {
        char *p = panel + g * PANEL_GROUP_BYTES;
        __m512i v[8];
        QG(pair_unpack)(fmt, w + g * wbytes, wnext, qh ? qh + g * 32 : NULL, G * 32, v);
        for (int s = 0; s < 8; s++) _mm512_store_si512((__m512i *)(p + PANEL_V + 64 * s), v[s]);
        __m512 dv, mv;
        QG(pair_scales)(fmt, dt, mt, dnext, sc, G * 16, g, blk, &dv, &mv);
        _mm512_store_ps((float *)(p + PANEL_D), dv);
        _mm512_store_ps((float *)(p + PANEL_M), mv);
        if (fmt == QG_Q6) {
            __m512 sclo, schi;
            QG(pair_subscales)(sc, G * 16, g, &sclo, &schi);
            _mm512_store_ps((float *)(p + PANEL_SCLO), sclo);
            _mm512_store_ps((float *)(p + PANEL_SCHI), schi);
        }
    }
}

/* W pairs (W: 1 or 2, panels p[0], p[1]: 16 or 32 weight rows) against R rows of x (R <= 4, in one
 * block of 8: row i's levels at x + 32 i, its table entries at [i]): a register tile of W x R int32
 * dots a group, each broadcast of four activation levels feeding W vpdpbusd, W x R independent
 * chains in program order (vpdpbusd's latency hidden), then pair_in's float sums per (pair, row).
 * `acc` [W * R].
 * q6 takes its -32 into each half's chain from the start (-32 x the half's level sum), so a half's
 * dot is of levels - 32: |dot| <= 16 x 32 x 127, and times its int8 sub-scale below 2^24. Both
 * products are then exact in fp32 and one fma rounds their sum once: the float that the tiles'
 * integer sum converts to, without two vpmulld (2 uops each here). pair_dot does the same. */
ALWAYS_INLINE void QG(panel_group)(const int fmt, const char *p0, const char *p1, const int W, const int8_t *x,
                                   const int32_t *xb, const float *xd, const int R, __m512 acc[]) {
    const char *p[2] = {p0, p1};
    __m512i dot[2][4], hi[2][4];
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) {
        const int32_t lo = (int32_t)(int16_t)xb[i], up = xb[i] >> 16;
        const __m512i start = fmt == QG_Q8 ? _mm512_set1_epi32(-128 * (lo + up))
                              : fmt == QG_Q6 ? _mm512_set1_epi32(-32 * lo)
                                             : _mm512_setzero_si512();
        const __m512i start_hi = fmt == QG_Q6 ? _mm512_set1_epi32(-32 * up) : _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int w = 0; w < W; w++) dot[w][i] = start, hi[w][i] = start_hi;
    }
#pragma GCC unroll 8
    for (int s = 0; s < 8; s++) {
        __m512i v[2];
#pragma GCC unroll 8
        for (int w = 0; w < W; w++) v[w] = _mm512_load_si512((const __m512i *)(p[w] + PANEL_V + 64 * s));
        const int off = fmt == QG_Q8 ? 4 * s : 16 * (s / 4) + 4 * (s % 4);
#pragma GCC unroll 8
        for (int i = 0; i < R; i++) {
            const __m512i xv = _mm512_set1_epi32(*(const int32_t *)(x + 32 * i + off));
#pragma GCC unroll 8
            for (int w = 0; w < W; w++) {
                if (fmt == QG_Q6 && s >= 4)
                    hi[w][i] = _mm512_dpbusd_epi32(hi[w][i], v[w], xv);
                else
                    dot[w][i] = _mm512_dpbusd_epi32(dot[w][i], v[w], xv);
            }
        }
    }
#pragma GCC unroll 8
    for (int w = 0; w < W; w++) {
        const __m512 dv = _mm512_load_ps((const float *)(p[w] + PANEL_D));
        __m512 sclo = _mm512_setzero_ps(), schi = sclo;
        if (fmt == QG_Q6)
            sclo = _mm512_load_ps((const float *)(p[w] + PANEL_SCLO)), schi = _mm512_load_ps((const float *)(p[w] + PANEL_SCHI));
#pragma GCC unroll 8
        for (int i = 0; i < R; i++) {
            const __m512 d = fmt == QG_Q6 ? _mm512_fmadd_ps(sclo, _mm512_cvtepi32_ps(dot[w][i]),
                                                            _mm512_mul_ps(schi, _mm512_cvtepi32_ps(hi[w][i])))
                                          : _mm512_cvtepi32_ps(dot[w][i]);
            acc[w * R + i] = _mm512_fmadd_ps(_mm512_mul_ps(dv, _mm512_set1_ps(xd[i])), d, acc[w * R + i]);
        }
    }
}

/* W pairs from tile t (panels at `panel`, one after the other) against rows r .. r+R-1 (one block
 * of 8 rows holds them). */
ALWAYS_INLINE void QG(panel_in)(const gemm_args *a, const char *panel, const int W, int64_t t, int64_t r, const int R,
                                const int fmt) {
    const int64_t G = a->G, K = a->K;
    const int has_m = fmt != QG_Q8 && fmt != QG_Q6;
    const char *p0 = panel, *p1 = panel + G * PANEL_GROUP_BYTES;
    const int8_t *xg = a->xq + x_at(r, K);
    const float *xd = a->xd + tab_at(r, G), *xs = a->xs + tab_at(r, G);
    const int32_t *xb = a->xb + tab_at(r, G);
    /* the next pass's output lines, asked for now: written once, they come from memory */
#pragma GCC unroll 8
    for (int i = 0; i < R; i++)
#pragma GCC unroll 2
        for (int w = 0; w < W; w++) __builtin_prefetch(a->y + (r + R + i) * a->ldy + (t + 2 * w) * TILE, 1, 3);
    __m512 acc[8];
#pragma GCC unroll 8
    for (int i = 0; i < W * R; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const int8_t *xa = xg + (g + PANEL_X_AHEAD) * 32 * TILE; /* past the end: a prefetch never faults */
        __builtin_prefetch(xa, 0, 3);
        if (R > 2)
            __builtin_prefetch(xa + 64, 0, 3);
        QG(panel_group)(fmt, p0 + g * PANEL_GROUP_BYTES, p1 + g * PANEL_GROUP_BYTES, W, xg + g * 32 * TILE, xb + g * TILE,
                        xd + g * TILE, R, acc);
    }
    if (has_m) {
        __m512 mac[8];
#pragma GCC unroll 8
        for (int i = 0; i < W * R; i++) mac[i] = _mm512_setzero_ps();
        for (int64_t g = 0; g < G; g++)
#pragma GCC unroll 8
            for (int w = 0; w < W; w++) {
                const __m512 mv = _mm512_load_ps((const float *)((w ? p1 : p0) + g * PANEL_GROUP_BYTES + PANEL_M));
#pragma GCC unroll 8
                for (int i = 0; i < R; i++) mac[w * R + i] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[g * TILE + i]), mac[w * R + i]);
            }
#pragma GCC unroll 8
        for (int i = 0; i < W * R; i++) acc[i] = _mm512_add_ps(acc[i], mac[i]);
    }
#pragma GCC unroll 8
    for (int w = 0; w < W; w++) {
        const int64_t t0 = t + 2 * w, cols = a->N - t0 * TILE < 2 * TILE ? a->N - t0 * TILE : 2 * TILE;
        const __mmask16 keep = (__mmask16)((1u << cols) - 1);
#pragma GCC unroll 8
        for (int i = 0; i < R; i++) _mm512_mask_storeu_ps(a->y + (r + i) * a->ldy + t0 * TILE, keep, acc[w * R + i]);
    }
}

/* Rows r .. end-1 (r a multiple of 4) in passes of 4 rows, the rest in one pass of fewer. */
ALWAYS_INLINE void QG(panel_pass)(const gemm_args *a, const char *panel, const int W, int64_t t, int64_t r, int64_t end,
                                  const int fmt) {
    for (; r + 4 <= end; r += 4) QG(panel_in)(a, panel, W, t, r, 4, fmt);
    switch (end - r) {
    case 3: QG(panel_in)(a, panel, W, t, r, 3, fmt); break;
    case 2: QG(panel_in)(a, panel, W, t, r, 2, fmt); break;
    case 1: QG(panel_in)(a, panel, W, t, r, 1, fmt); break;
    }
}

ALWAYS_INLINE void QG(panel_fmt)(const gemm_args *a, char *panel, int64_t t, const int tiles, int64_t r, int64_t end,
                                 const int fmt) {
    const int64_t next = a->G * PANEL_GROUP_BYTES;
    QG(panel_unpack_in)(a, t, panel, fmt);
    if (tiles == 4) {
        QG(panel_unpack_in)(a, t + 2, panel + next, fmt);
        QG(panel_pass)(a, panel, 2, t, r, end, fmt);
    } else
        QG(panel_pass)(a, panel, 1, t, r, end, fmt);
}

/* Tiles t .. t+tiles-1 (4 or 2) against rows r .. end-1 through panels (2 * PANEL_GROUP_BYTES * G
 * bytes at `panel`). */
static void QG(panel_rows)(const gemm_args *a, char *panel, int64_t t, int tiles, int64_t r, int64_t end) {
    switch (a->fmt) {
    case QG_Q6: QG(panel_fmt)(a, panel, t, tiles, r, end, QG_Q6); break;
    case QG_Q5: QG(panel_fmt)(a, panel, t, tiles, r, end, QG_Q5); break;
    case QG_Q4: QG(panel_fmt)(a, panel, t, tiles, r, end, QG_Q4); break;
    case QG_Q4K: QG(panel_fmt)(a, panel, t, tiles, r, end, QG_Q4K); break;
    case QG_Q4_0: QG(panel_fmt)(a, panel, t, tiles, r, end, QG_Q4_0); break;
    case QG_Q5_0: QG(panel_fmt)(a, panel, t, tiles, r, end, QG_Q5_0); break;
    default: QG(panel_fmt)(a, panel, t, tiles, r, end, QG_Q8);
    }
}

static void QG(pair_rows)(const gemm_args *a, int64_t t, int64_t span, int64_t r, int64_t end) {
    switch (a->fmt) {
    case QG_Q6: QG(pair_fmt)(a, t, span, &r, end, QG_Q6); break;
    case QG_Q5: QG(pair_fmt)(a, t, span, &r, end, QG_Q5); break;
    case QG_Q4: QG(pair_fmt)(a, t, span, &r, end, QG_Q4); break;
    case QG_Q4K: QG(pair_fmt)(a, t, span, &r, end, QG_Q4K); break;
    case QG_Q4_0: QG(pair_fmt)(a, t, span, &r, end, QG_Q4_0); break;
    case QG_Q5_0: QG(pair_fmt)(a, t, span, &r, end, QG_Q5_0); break;
    default: QG(pair_fmt)(a, t, span, &r, end, QG_Q8);
    }
}
#endif
