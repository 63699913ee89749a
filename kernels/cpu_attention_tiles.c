/* A long prompt chunk's causal attention on AMX-BF16 tiles, over a bf16 paged cache.
 *
 * torch's fused CPU kernel ran this at ~0.6 TFLOP/s against the tile matmuls' ~1.7 (a
 * 1,024-token chunk at Qwen3-0.6B's heads, two Xeon cores): its inner products are small
 * oneDNN calls. Here both products are tile dot products over layouts packed once a call:
 *
 *   kp [Hk, L / 16, D / 2, 16, 2]  for 16 keys, each pair of features (d, d + 1) of the 16
 *                                  keys side by side: a B tile of S = Q K^T (32 features)
 *   vp [Hk, D / 16, L / 2, 16, 2]  for 16 features, each pair of keys (t, t + 1) of them
 *                                  side by side: a B tile of O = P V (32 keys)
 *
 * (L: the chunk's keys, context and chunk, rounded up to 32; the pad is zero.) A work item
 * is 32 query rows of one query head: its scores over the keys up to its last row's
 * position in fp32 (rows by L, in scratch), an exact softmax in fp32 (scaled, masked,
 * rounded to bf16 for the second product, as torch's bf16 kernel does), then O by 32
 * features at a time in four C tiles, normalised in fp32 on the way out. A 32-row block's
 * keys stop at its last row's position, so the causal half is never computed.
 *
 * Shapes: q [n, Hq, D] fp32, row stride qs (the chunk's rows; rounded to bf16 here);
 * caches [num_blocks, bs, Hk, D] bf16 (element strides block_stride, tok_stride);
 * table: the chunk's block ids (int32); out [n, Hq, D] fp32, row stride os. D a multiple
 * of 32 (the caller checks). Query row r sits at position context_len + r and reads keys
 * 0 .. context_len + r.
 * Returns 0, or -1 where this build has no tiles or scratch could not be had.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__linux__)
#include <immintrin.h>
#include "cpu_tiles.h"
#define HAS_TILES 1
#endif

#ifdef HAS_TILES
#define QB 32 /* query rows a work item */

/* 2^t for t <= 0, 16 at a time: 2^round(t) times a degree-6 polynomial in the rest
 * (|rest| <= 0.5; relative error ~2e-7, under bf16's rounding of P by four orders), 0 far
 * below (scalef underflows gracefully, and -inf is masked by the caller). */
static inline __m512 exp2_le0(__m512 t) {
    t = _mm512_max_ps(t, _mm512_set1_ps(-150.0f));
    const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, k);
    __m512 y = _mm512_set1_ps(1.5403530393381606e-4f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.3333558146428443e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6181291076284772e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5504108664821580e-2f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022650695910071e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718055994531e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, k);
}

static void *alloc_aligned(size_t bytes) {
    void *p = NULL;
    return posix_memalign(&p, 64, (bytes + 63) / 64 * 64) == 0 ? p : NULL;
}

/* Where token t's row (every KV head) starts in a cache, in elements. */
static inline int64_t token_at(const int32_t *table, int64_t t, int64_t bs, int64_t block_stride,
                               int64_t tok_stride) {
    return (int64_t)table[t / bs] * block_stride + (t % bs) * tok_stride;
}

/* Key rows [t0, t0 + 16) of KV head h into kp's block and their pairs into vp. */
static void pack_keys(const uint16_t *kc, const uint16_t *vc, const int32_t *table, int64_t h,
                      int64_t t0, int64_t total, int64_t D, int64_t L, int64_t bs,
                      int64_t block_stride, int64_t tok_stride, uint16_t *kp, uint16_t *vp) {
    uint32_t *kb = (uint32_t *)(kp + t0 * D); /* this block: [D / 2][16] words */
    for (int64_t j = 0; j < 16; j++) {
        int64_t t = t0 + j;
        if (t >= total) {
            for (int64_t p = 0; p < D / 2; p++)
                kb[p * 16 + j] = 0;
            continue;
        }
        const uint32_t *row =
            (const uint32_t *)(kc + token_at(table, t, bs, block_stride, tok_stride) + h * D);
        for (int64_t p = 0; p < D / 2; p++)
            kb[p * 16 + j] = row[p];
    }
    for (int64_t t = t0; t < t0 + 16; t += 2) {
        /* V rows t and t + 1 of this head, or none past the keys */
        const uint16_t *va = t < total ? vc + token_at(table, t, bs, block_stride, tok_stride) : 0;
        const uint16_t *vb =
            t + 1 < total ? vc + token_at(table, t + 1, bs, block_stride, tok_stride) : 0;
        for (int64_t c = 0; c < D / 16; c++) {
            const __m256i zero = _mm256_setzero_si256();
            __m256i a = va ? _mm256_loadu_si256((const __m256i *)(va + h * D + c * 16)) : zero;
            __m256i b = vb ? _mm256_loadu_si256((const __m256i *)(vb + h * D + c * 16)) : zero;
            __m512i pair = _mm512_or_si512(_mm512_cvtepu16_epi32(a),
                                           _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
            _mm512_storeu_si512(vp + c * (L / 2) * 32 + (t / 2) * 32, pair);
        }
    }
}

/* Rows [r0, r0 + QB) of query head h over its KV head's kp and vp. Scratch: s [QB, L] fp32,
 * p [QB, L] bf16, qa [QB, D] bf16, o [QB, D] fp32. */
static void attend_block(const float *q, int64_t qs, int64_t n, int64_t context_len,
                         int64_t D, int64_t L, const uint16_t *kp, const uint16_t *vp,
                         float scale, int64_t h, int64_t r0, float *out, int64_t os, float *s,
                         uint16_t *p, uint16_t *qa, float *o) {
    const int64_t num_rows = n - r0 < QB ? n - r0 : QB;
    const int64_t num_keys = context_len + r0 + num_rows; /* the last row's keys */
    const int64_t span = (num_keys + 31) / 32 * 32;
    /* the block's queries rounded to bf16 (as torch's .to() rounds: to nearest even), the
     * rows past the chunk zero */
    for (int64_t i = 0; i < QB; i++)
        for (int64_t d = 0; d < D; d += 16) {
            __m512 x = i < num_rows ? _mm512_loadu_ps(q + (r0 + i) * qs + h * D + d)
                                    : _mm512_setzero_ps();
            _mm256_storeu_si256((__m256i *)(qa + i * D + d), (__m256i)_mm512_cvtneps_pbh(x));
        }
    /* S = Q K^T: 32 rows by 32 keys a pass, 32 features a step */
    for (int64_t k0 = 0; k0 < span; k0 += 32)
        tiles_32x32(qa, D, kp + k0 * D, kp + (k0 + 16) * D, D, s + k0, L);
    /* softmax of each row over its own keys, in fp32; P in bf16, zero past the keys */
    float inv[QB];
    const float c = scale * 1.4426950408889634f; /* exp(x * scale) = 2^(x * c) */
    for (int64_t i = 0; i < QB; i++) {
        const float *si = s + i * L;
        uint16_t *pi = p + i * L;
        const int64_t num = i < num_rows ? context_len + r0 + i + 1 : 0;
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < num; j += 16) {
            __mmask16 live = num - j >= 16 ? 0xffff : (__mmask16)((1u << (num - j)) - 1);
            vmax = _mm512_mask_max_ps(vmax, live, vmax, _mm512_loadu_ps(si + j));
        }
        const __m512 mc = _mm512_set1_ps(num ? _mm512_reduce_max_ps(vmax) * c : 0.0f);
        const __m512 vc = _mm512_set1_ps(c);
        __m512 vsum = _mm512_setzero_ps();
        for (int64_t j = 0; j < span; j += 16) {
            __mmask16 live = num - j >= 16   ? 0xffff
                             : num - j <= 0 ? 0
                                            : (__mmask16)((1u << (num - j)) - 1);
            __m512 e = _mm512_maskz_mov_ps(live, exp2_le0(_mm512_fmsub_ps(
                                                     _mm512_loadu_ps(si + j), vc, mc)));
            vsum = _mm512_add_ps(vsum, e);
            _mm256_storeu_si256((__m256i *)(pi + j), (__m256i)_mm512_cvtneps_pbh(e));
        }
        inv[i] = num ? 1.0f / _mm512_reduce_add_ps(vsum) : 0.0f;
    }
    /* O = P V: 32 rows by 32 features a pass, 32 keys a step */
    for (int64_t c = 0; c < D; c += 32) {
        const uint16_t *b0 = vp + (c / 16) * (L / 2) * 32;
        tiles_32x32(p, L, b0, b0 + (L / 2) * 32, span, o + c, D);
    }
    for (int64_t i = 0; i < num_rows; i++) {
        float *dst = out + (r0 + i) * os + h * D;
        const float f = inv[i];
        _Pragma("omp simd")
        for (int64_t d = 0; d < D; d++) dst[d] = o[i * D + d] * f;
    }
}
#endif

int pdserve_prefill_tiles_bf16(const float *q, int64_t qs, const uint16_t *kc,
                               const uint16_t *vc, const int32_t *table, int64_t n,
                               int64_t context_len, int64_t Hq,
                               int64_t Hk, int64_t D, int64_t bs, int64_t block_stride,
                               int64_t tok_stride, float scale, float *out, int64_t os,
                               int64_t num_threads) {
#ifdef HAS_TILES
    const int64_t total = context_len + n, L = (total + 31) / 32 * 32, G = Hq / Hk;
    uint16_t *kp = alloc_aligned((size_t)Hk * L * D * 2);
    uint16_t *vp = alloc_aligned((size_t)Hk * L * D * 2);
    int failed = kp == NULL || vp == NULL;
    if (!failed) {
        const int64_t num_packs = Hk * (L / 16), num_blocks = (n + QB - 1) / QB;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
        {
#pragma omp for schedule(static)
            for (int64_t w = 0; w < num_packs; w++) {
                int64_t h = w / (L / 16), t0 = (w % (L / 16)) * 16;
                pack_keys(kc, vc, table, h, t0, total, D, L, bs, block_stride, tok_stride,
                          kp + h * L * D, vp + h * L * D);
            }
            float *s = alloc_aligned((size_t)QB * L * 4 + (size_t)QB * D * 4);
            uint16_t *p = alloc_aligned((size_t)QB * L * 2 + (size_t)QB * D * 2);
            if (s == NULL || p == NULL)
                failed = 1;
            else
                configure_tiles();
            /* NOTE: every thread reaches the loop (a work-sharing loop must be met by all);
             * one without scratch skips the items it takes, and the call reports -1 */
#pragma omp for schedule(dynamic, 1)
            for (int64_t w = 0; w < Hq * num_blocks; w++) {
                if (s == NULL || p == NULL)
                    continue;
                /* the last blocks (the most keys) first, so the threads finish together */
                int64_t b = num_blocks - 1 - w / Hq, h = w % Hq;
                attend_block(q, qs, n, context_len, D, L, kp + (h / G) * L * D,
                             vp + (h / G) * L * D, scale, h, b * QB, out, os, s, p,
                             p + QB * L, s + QB * L);
            }
            if (s != NULL && p != NULL)
                _tile_release();
            free(s);
            free(p);
        }
    }
    free(kp);
    free(vp);
    return failed ? -1 : 0;
#else
    (void)q, (void)kc, (void)vc, (void)table, (void)n, (void)context_len, (void)Hq, (void)Hk;
    (void)D, (void)bs, (void)block_stride, (void)tok_stride, (void)scale, (void)out, (void)os;
    (void)num_threads, (void)qs;
    return -1;
#endif
}

/* 1 where this build has the kernel above (AMX and AVX512-BF16), else 0. */
int pdserve_prefill_tiles_available(void) {
#ifdef HAS_TILES
    return 1;
#else
    return 0;
#endif
}
