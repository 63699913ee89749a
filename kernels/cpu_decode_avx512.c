/* Decode attention over a bf16 cache with 128-dim heads (every Qwen3 size), on AVX-512:
 * one sequence's query heads for a range of its KV heads, as cpu_attention.c's attend_bf16
 * and with its arguments, which calls it where this build has it.
 *
 * NOTE: why not the portable loops: built for this CPU, they run on 256-bit vectors (the
 * compiler's preference on these cores), widen a token's K once per query head rather than
 * once per group, and leave the rows' loads to the hardware prefetchers, which lose the
 * stream at every block. Here a KV head's row is widened once for its G query heads, a
 * (token, head) score is two FMA chains of 512 bits, and rows are fetched AHEAD tokens
 * ahead through the block table: a 0.6B-shape step at batch 32, 171 -> 139 ms (pdserve bench
 * decode, a Xeon's two cores).
 * The math is attend_bf16's: fp32 products of the fp32 query and the widened bf16 cache.
 *
 * Shapes (elements; the last dimension contiguous):
 *   q, out   [Hq, 128] fp32: the range's query heads, G per KV head
 *   kc, vc   the cache from the range's first KV head: token t of block b at
 *            b * block_stride + (t % bs) * tok_stride
 *   scores   scratch [Hq, n] fp32 */
#include <math.h>
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>

const int pdserve_has_attend_bf16_d128 = 1;
#define AHEAD 8 /* tokens: rows are read this far ahead (a row is 2 KB apart, blocks anywhere) */

/* 16 bf16 at p, widened to fp32 (a bf16 is the top half of an fp32). */
static inline __m512 widen16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static const uint16_t *row_of(const uint16_t *c, const int32_t *table, int64_t t, int64_t bs,
                              int64_t block_stride, int64_t tok_stride) {
    return c + (int64_t)table[t / bs] * block_stride + (t % bs) * tok_stride;
}

/* Token t + AHEAD's row (its first num_bytes) on its way into L2. */
static inline void fetch_ahead(const uint16_t *c, const int32_t *table, int64_t t, int64_t n,
                               int64_t bs, int64_t block_stride, int64_t tok_stride,
                               int64_t num_bytes) {
    if (t + AHEAD >= n) return;
    const char *r = (const char *)row_of(c, table, t + AHEAD, bs, block_stride, tok_stride);
    for (int64_t b = 0; b < num_bytes; b += 64) _mm_prefetch(r + b, _MM_HINT_T1);
}

/* cpu_attention.c: head h's softmax over its query's tokens, zeros after them */
void pdserve_softmax_head(float *sh, int64_t n, int64_t h, int64_t Q);

void pdserve_attend_bf16_d128(const float *q, const uint16_t *kc, const uint16_t *vc,
                              const int32_t *table, int64_t n, int64_t Hq, int64_t G,
                              int64_t bs, int64_t block_stride, int64_t tok_stride,
                              float scale, int64_t Q, float *scores, float *out) {
    const int64_t num_kv = Hq / G;
    /* Scores: each token's row, a KV head at a time, widened once for its G query heads. */
    for (int64_t t = 0; t < n; t++) {
        const uint16_t *k = row_of(kc, table, t, bs, block_stride, tok_stride);
        fetch_ahead(kc, table, t, n, bs, block_stride, tok_stride, num_kv * 256);
        for (int64_t g = 0; g < num_kv; g++) {
            __m512 kv[8];
            for (int i = 0; i < 8; i++) kv[i] = widen16(k + g * 128 + 16 * i);
            for (int64_t j = 0; j < G; j++) {
                const float *qh = q + (g * G + j) * 128;
                __m512 s0 = _mm512_mul_ps(_mm512_loadu_ps(qh), kv[0]);
                __m512 s1 = _mm512_mul_ps(_mm512_loadu_ps(qh + 16), kv[1]);
                for (int i = 2; i < 8; i += 2) {
                    s0 = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * i), kv[i], s0);
                    s1 = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * i + 16), kv[i + 1], s1);
                }
                const float s = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
                scores[(g * G + j) * n + t] = s * scale;
            }
        }
    }
    for (int64_t h = 0; h < Hq; h++) pdserve_softmax_head(scores + h * n, n, h, Q);
    /* P @ V: token rows in order (a stream the prefetchers follow), each KV head's widened
     * once for its G query heads; the sums [Hq, 128] stay in L1. */
    for (int64_t i = 0; i < Hq * 128; i += 16) _mm512_storeu_ps(out + i, _mm512_setzero_ps());
    for (int64_t t = 0; t < n; t++) {
        const uint16_t *v = row_of(vc, table, t, bs, block_stride, tok_stride);
        fetch_ahead(vc, table, t, n, bs, block_stride, tok_stride, num_kv * 256);
        for (int64_t g = 0; g < num_kv; g++) {
            __m512 x[8];
            for (int i = 0; i < 8; i++) x[i] = widen16(v + g * 128 + 16 * i);
            for (int64_t j = 0; j < G; j++) {
                float *o = out + (g * G + j) * 128;
                const __m512 w = _mm512_set1_ps(scores[(g * G + j) * n + t]);
                for (int i = 0; i < 8; i++)
                    _mm512_storeu_ps(o + 16 * i,
                                     _mm512_fmadd_ps(w, x[i], _mm512_loadu_ps(o + 16 * i)));
            }
        }
    }
}

#else

const int pdserve_has_attend_bf16_d128 = 0;

void pdserve_attend_bf16_d128(const float *q, const uint16_t *kc, const uint16_t *vc,
                              const int32_t *table, int64_t n, int64_t Hq, int64_t G,
                              int64_t bs, int64_t block_stride, int64_t tok_stride,
                              float scale, int64_t Q, float *scores, float *out) {
    /* never called: cpu_attention.c asks pdserve_has_attend_bf16_d128 first */
    (void)q, (void)kc, (void)vc, (void)table, (void)n, (void)Hq, (void)G, (void)bs;
    (void)block_stride, (void)tok_stride, (void)scale, (void)Q, (void)scores, (void)out;
}

#endif
