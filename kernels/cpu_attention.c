/* Paged decode attention for CPU: one query per sequence, reading K and V in
 * place from the block cache (no gather into a dense copy).
 *
 * Built by kernels/cpu.py with the system C compiler (-O3 -march=native) and
 * called through ctypes; plain C with a C ABI, so building it needs no torch
 * headers. kernels/portable.py is the reference it is tested against.
 *
 * Shapes (element strides for the caches; the last dimension is contiguous):
 *   q, out       [B, Hq, D] fp32, contiguous
 *   k, v cache   [num_blocks, block_size, Hk, D] (fp32 or bf16), or [.., Hk, D + 4] bytes
 *                (8-bit KV, kernels/kv_quant.py: D int8 or e4m3 values, then an fp32 scale)
 *   block_tables [B, bt_stride] int32;  seq_lens [B] int32 (tokens, >= 1)
 * Query head h reads KV head h / (Hq / Hk). A verify step's row asks Q queries (its next
 * input and Q - 1 drafts) as Q times the heads, [B, Hk, G, Q, D]: query j of a row of n
 * tokens reads the first n - (Q - 1 - j) of them (Q = 1: a plain step).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Scratch aligned to a cache line. NOTE: malloc's 16-byte alignment puts every vector
 * load of a large (mmap-backed) buffer across two cache lines: the same call then runs
 * 1.6x slower, depending only on where the heap placed it. NULL when none can be had. */
static float *alloc_scratch(size_t num_floats) {
    void *p = NULL;
    size_t size = (num_floats * sizeof(float) + 63) / 64 * 64;
    return posix_memalign(&p, 64, size) == 0 ? (float *)p : NULL;
}

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Head h's scores sh[0:n] -> its softmax over the first n - (Q - 1 - h % Q) (its query's
 * tokens), zeros after them. cpu_decode_avx512.c's kernel calls it too. */
void pdserve_softmax_head(float *sh, int64_t n, int64_t h, int64_t Q) {
    int64_t m_n = n - (Q - 1 - h % Q);
    if (m_n < 1) m_n = 1;
    float m = sh[0], sum = 0.0f;
    for (int64_t t = 1; t < m_n; t++) m = sh[t] > m ? sh[t] : m;
    _Pragma("omp simd reduction(+:sum)")
    for (int64_t t = 0; t < m_n; t++) { sh[t] = expf(sh[t] - m); sum += sh[t]; }
    const float inv = 1.0f / sum;
    _Pragma("omp simd")
    for (int64_t t = 0; t < m_n; t++) sh[t] *= inv;
    for (int64_t t = m_n; t < n; t++) sh[t] = 0.0f;
}

/* One sequence: its Hq query heads over n tokens. A token's K (and V) row holds
 * every KV head ([Hk, D], contiguous), so it is read once, by all query heads.
 * scores: scratch [Hq, n]; acc: scratch [Hq, D]. ROW: a head's row, in elements; SCALE(row):
 * what the row's values are multiplied by (8-bit rows' own scale; 1 for the others). */
#define DEFINE_ATTEND(NAME, T, LOAD, ROW, SCALE)                                          \
static void NAME(const float *q, const T *kc, const T *vc, const int32_t *table,        \
                 int64_t n, int64_t Hq, int64_t G, int64_t D, int64_t bs,                \
                 int64_t block_stride, int64_t tok_stride, float scale, int64_t Q,       \
                 float *scores, float *acc, float *out) {                                \
    const T *k = kc, *v = vc;                                                            \
    for (int64_t t = 0; t < n; t++) {                                                    \
        if (t % bs == 0) k = kc + (int64_t)table[t / bs] * block_stride;                 \
        else k += tok_stride;                                                            \
        for (int64_t h = 0; h < Hq; h++) {                                               \
            const float *qh = q + h * D;                                                 \
            const T *kh = k + (h / G) * (ROW);                                           \
            float s = 0.0f;                                                              \
            _Pragma("omp simd reduction(+:s)")                                          \
            for (int64_t d = 0; d < D; d++) s += qh[d] * LOAD(kh[d]);                    \
            scores[h * n + t] = s * SCALE(kh) * scale;                                   \
        }                                                                                \
    }                                                                                    \
    for (int64_t h = 0; h < Hq; h++)                                                     \
        pdserve_softmax_head(scores + h * n, n, h, Q);                                   \
    memset(acc, 0, sizeof(float) * Hq * D);                                              \
    for (int64_t t = 0; t < n; t++) {                                                    \
        if (t % bs == 0) v = vc + (int64_t)table[t / bs] * block_stride;                 \
        else v += tok_stride;                                                            \
        for (int64_t h = 0; h < Hq; h++) {                                               \
            const T *vh = v + (h / G) * (ROW);                                           \
            float p = scores[h * n + t] * SCALE(vh), *a = acc + h * D;                   \
            _Pragma("omp simd")                                                          \
            for (int64_t d = 0; d < D; d++) a[d] += p * LOAD(vh[d]);                     \
        }                                                                                \
    }                                                                                    \
    memcpy(out, acc, sizeof(float) * Hq * D);                                            \
}

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)
#define UNSCALED(row) 1.0f
DEFINE_ATTEND(attend_f32, float, LOAD_F32, D, UNSCALED)
DEFINE_ATTEND(attend_bf16, uint16_t, LOAD_BF16, D, UNSCALED)

/* 8-bit rows (kernels/kv_quant.py): a (token, head) row is D values, then its fp32 scale,
 * which multiplies the row's score (K) or its token's weight (V): each row is read once,
 * in place, at a byte a value. An e4m3 byte's exponent and mantissa, moved to an fp32's
 * (bias 127 for 7), are its value times 2^-120, subnormals included: one multiply, no
 * table (a table's lookups keep the loop from vectorizing: 4.5x the bf16 step). NOTE: the
 * two NaN codes read as +-480; the quantizer never writes them (it clamps to 448).
 * NOTE: the compiler vectorizes these loops 64 bytes a vector: a 16-dim head (the tiny
 * model's) runs in the scalar tail, ~3x the fp32 kernel's time; 16 a vector (simdlen)
 * fixes that and doubles a 128-dim head's (Qwen3's): 128 is what these are for. */
static inline float e4m3_to_f32(uint8_t x) {
    const uint32_t u = ((uint32_t)(x & 0x7F) << 20) | ((uint32_t)(x & 0x80) << 24);
    float f;
    memcpy(&f, &u, sizeof f);
    return f * 0x1p120f;
}

static inline float row_scale(const uint8_t *row, int64_t D) {
    float s;
    memcpy(&s, row + D, sizeof s);
    return s;
}

#define LOAD_I8(x) ((float)(int8_t)(x))
#define LOAD_E4M3(x) e4m3_to_f32(x)
#define ROW_SCALE(row) row_scale((row), D)
DEFINE_ATTEND(attend_i8, uint8_t, LOAD_I8, D + 4, ROW_SCALE)
DEFINE_ATTEND(attend_e4m3, uint8_t, LOAD_E4M3, D + 4, ROW_SCALE)

/* cpu_decode_avx512.c: 128-dim heads of a bf16 cache, where this build has AVX-512 */
extern const int pdserve_has_attend_bf16_d128;
void pdserve_attend_bf16_d128(const float *q, const uint16_t *kc, const uint16_t *vc,
                              const int32_t *table, int64_t n, int64_t Hq, int64_t G,
                              int64_t bs, int64_t block_stride, int64_t tok_stride,
                              float scale, int64_t Q, float *scores, float *out);

static void attend_bf16_best(const float *q, const uint16_t *kc, const uint16_t *vc,
                             const int32_t *table, int64_t n, int64_t Hq, int64_t G, int64_t D,
                             int64_t bs, int64_t block_stride, int64_t tok_stride, float scale,
                             int64_t Q, float *scores, float *acc, float *out) {
    if (pdserve_has_attend_bf16_d128 && D == 128)
        pdserve_attend_bf16_d128(q, kc, vc, table, n, Hq, G, bs, block_stride, tok_stride,
                                 scale, Q, scores, out);
    else
        attend_bf16(q, kc, vc, table, n, Hq, G, D, bs, block_stride, tok_stride, scale, Q,
                    scores, acc, out);
}

/* Returns 0, or -1 when scratch memory could not be had. Work item i is sequence
 * i / num_parts's part i % num_parts: a contiguous range of its KV heads with their query
 * groups (a head range, its KV columns and its output are offsets into the same rows).
 * Items are dealt out over num_threads OpenMP threads where built with OpenMP; a batch
 * lighter than the threads splits each sequence's heads in as many parts, so one
 * sequence still runs on every thread. NOTE: a part reads its heads' slice of every
 * token row: parts no more than the threads, or the rows are walked again for nothing. */
#define DEFINE_DECODE(NAME, T, ATTEND, ROW)  /* ROW: a head's row in the cache, elements */  \
int NAME(const float *q, const T *kc, const T *vc, const int32_t *block_tables,         \
         int64_t bt_stride, const int32_t *seq_lens, float *out, int64_t B, int64_t Hq,  \
         int64_t Hk, int64_t D, int64_t bs, int64_t block_stride, int64_t tok_stride,    \
         float scale, int64_t num_threads, int64_t Q) {                                  \
    int64_t max_n = 1, G = Hq / Hk;  /* NOTE: Q divides G: a part starts at a query 0 */  \
    if (B <= 0) return 0;                                                                \
    for (int64_t b = 0; b < B; b++) max_n = seq_lens[b] > max_n ? seq_lens[b] : max_n;  \
    if (num_threads < 1) num_threads = 1;                                                \
    int64_t num_parts = B >= num_threads ? 1 : (num_threads + B - 1) / B;                \
    if (num_parts > Hk) num_parts = Hk;                                                  \
    int64_t num_items = B * num_parts, part_heads = (Hk + num_parts - 1) / num_parts * G; \
    if (num_threads > num_items) num_threads = num_items;                                \
    int failed = 0;                                                                      \
    _Pragma("omp parallel num_threads(num_threads) reduction(|:failed)")                 \
    {                                                                                    \
        float *scratch = alloc_scratch(part_heads * (max_n + D));                        \
        failed |= scratch == NULL;                                                       \
        _Pragma("omp for schedule(static)")                                              \
        for (int64_t i = 0; i < num_items; i++) {                                        \
            int64_t b = i / num_parts, p = i % num_parts;                                \
            int64_t g0 = Hk * p / num_parts, g1 = Hk * (p + 1) / num_parts;              \
            int64_t at = b * Hq * D + g0 * G * D;                                        \
            int64_t n = seq_lens[b] < 1 ? 1 : seq_lens[b];                               \
            if (scratch)                                                                 \
                ATTEND(q + at, kc + g0 * (ROW), vc + g0 * (ROW), block_tables + b * bt_stride, \
                       n, (g1 - g0) * G, G, D, bs, block_stride, tok_stride, scale, Q,   \
                       scratch, scratch + (g1 - g0) * G * max_n, out + at);              \
        }                                                                                \
        free(scratch);                                                                   \
    }                                                                                    \
    return failed ? -1 : 0;                                                              \
}

DEFINE_DECODE(pdserve_decode_attention_f32, float, attend_f32, D)
DEFINE_DECODE(pdserve_decode_attention_bf16, uint16_t, attend_bf16_best, D)
DEFINE_DECODE(pdserve_decode_attention_i8, uint8_t, attend_i8, D + 4)
DEFINE_DECODE(pdserve_decode_attention_e4m3, uint8_t, attend_e4m3, D + 4)

/* ---- paged prefill attention: causal, over chunks whose KV is in the cache ----
 *
 * Work item w = chunk * Hk + g: chunk's query rows for the G query heads of KV
 * head g. Its keys (context and chunk, n of them) are packed once: K in tiles of
 * KB keys, each transposed [D, KB], so a tile's scores are D vector FMAs kept in
 * registers (no horizontal sums); V as [n, D]. Query row r sits at position ctx + r and reads keys 0 .. ctx + r.
 *   q, out      [T, Hq, D] fp32 contiguous (chunks back to back from q_starts)
 *   tables      [num_chunks, bt_stride] int32; q_starts, q_lens, ctx_lens [num_chunks] int32
 * Items [item0, item1) only, so callers can split the work over threads. */
#define KB 32   /* keys per score tile */
#define DB 16   /* output features per register tile: head_dim must be a multiple */
#define JU 2    /* keys in flight per output tile (KB must be a multiple) */
#define QV 8    /* query vectors sharing each K and V load */

/* sc[0:L] -> exp(sc - max), zero up to round_up(Lpad, JU); returns 1 / sum. */
static float softmax_in_place(float *sc, int64_t L, int64_t Lpad) {
    float m = sc[0], sum = 0.0f;
    _Pragma("omp simd reduction(max:m)")
    for (int64_t j = 0; j < L; j++) m = sc[j] > m ? sc[j] : m;
    _Pragma("omp simd reduction(+:sum)")
    for (int64_t j = 0; j < L; j++) { sc[j] = expf(sc[j] - m); sum += sc[j]; }
    for (int64_t j = L; j < (Lpad + JU - 1) / JU * JU; j++) sc[j] = 0.0f;
    return 1.0f / sum;
}

/* For NV query vectors at once (each over its own L[v] keys, the last having the most,
 * Lmax), so that each K and V load feeds all NV and every sum is its own FMA chain:
 *   scores_NV      scores against packed K tiles into sc[v] (NV x KB sums in registers);
 *   softmax_pv_NV  o[v][D] = softmax(sc[v][0:L[v]]) @ V; sc is overwritten.
 *                  vp: [>= round_up(Lmax, JU), D], rows past the keys zero. */
#define DEFINE_QV(NV)                                                                        \
static void scores_##NV(const float *const *qv, const float *kt, int64_t Lmax, int64_t D,    \
                      float scale, float *const *sc) {                                       \
    for (int64_t j0 = 0; j0 < Lmax; j0 += KB) {                                              \
        float s[NV][KB] = {{0}};                                                             \
        for (int64_t d = 0; d < D; d++) {                                                    \
            const float *kd = kt + (j0 * D + d * KB);                                        \
            for (int64_t v = 0; v < NV; v++) {                                               \
                const float a = qv[v][d];                                                    \
                _Pragma("omp simd")                                                          \
                for (int64_t j = 0; j < KB; j++) s[v][j] += a * kd[j];                       \
            }                                                                                \
        }                                                                                    \
        for (int64_t v = 0; v < NV; v++) {                                                   \
            _Pragma("omp simd")                                                              \
            for (int64_t j = 0; j < KB; j++) sc[v][j0 + j] = s[v][j] * scale;                \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
                                                                                             \
static void softmax_pv_##NV(float *const *sc, const int64_t *L, const float *vp, int64_t D,  \
                          float *const *o) {                                                 \
    const int64_t Lmax = L[NV - 1];                                                          \
    float inv[NV];                                                                           \
    for (int64_t v = 0; v < NV; v++) inv[v] = softmax_in_place(sc[v], L[v], Lmax);           \
    for (int64_t d0 = 0; d0 < D; d0 += DB) {   /* DB outputs in registers */                 \
        float a[NV][JU][DB] = {{{0}}};         /* JU sums each: no FMA latency chain */      \
        for (int64_t j = 0; j < Lmax; j += JU) {                                             \
            for (int64_t u = 0; u < JU; u++) {                                               \
                const float *vj = vp + (j + u) * D + d0;                                     \
                for (int64_t v = 0; v < NV; v++) {                                           \
                    const float p = sc[v][j + u];                                            \
                    _Pragma("omp simd")                                                      \
                    for (int64_t d = 0; d < DB; d++) a[v][u][d] += p * vj[d];                \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        for (int64_t v = 0; v < NV; v++) {                                                   \
            for (int64_t u = 1; u < JU; u++)                                                 \
                for (int64_t d = 0; d < DB; d++) a[v][0][d] += a[v][u][d];                   \
            _Pragma("omp simd")                                                              \
            for (int64_t d = 0; d < DB; d++) o[v][d0 + d] = a[v][0][d] * inv[v];             \
        }                                                                                    \
    }                                                                                        \
}

DEFINE_QV(QV)
DEFINE_QV(1)

#define DEFINE_PREFILL(NAME, T, LOAD)                                                    \
int NAME(const float *q, const T *kc, const T *vc, const int32_t *tables,               \
         int64_t bt_stride, const int32_t *q_starts, const int32_t *q_lens,             \
         const int32_t *ctx_lens, float *out, int64_t Hq, int64_t Hk, int64_t D,        \
         int64_t bs, int64_t block_stride, int64_t tok_stride, float scale,             \
         int64_t item0, int64_t item1) {                                                \
    const int64_t G = Hq / Hk;                                                          \
    int64_t max_n = 1;                                                                  \
    for (int64_t w = item0; w < item1; w++) {                                           \
        int64_t n = (int64_t)ctx_lens[w / Hk] + q_lens[w / Hk];                         \
        max_n = n > max_n ? n : max_n;                                                  \
    }                                                                                   \
    max_n = (max_n + KB - 1) / KB * KB;                                                 \
    float *kt = alloc_scratch(2 * D * max_n + QV * max_n);                               \
    if (!kt) return -1;                                                                 \
    float *vp = kt + D * max_n, *sc[QV];                                                \
    for (int64_t v = 0; v < QV; v++) sc[v] = vp + D * max_n + v * max_n;                \
    for (int64_t w = item0; w < item1; w++) {                                           \
        const int64_t c = w / Hk, g = w % Hk, ctx = ctx_lens[c], nq = q_lens[c];        \
        const int64_t n_real = ctx + nq, n = (n_real + KB - 1) / KB * KB;               \
        const int32_t *table = tables + c * bt_stride;                                  \
        /* The pads of the last tile: zero keys, and zero values (never 0 * garbage). */ \
        memset(kt + n_real / KB * KB * D, 0, sizeof(float) * KB * D);                   \
        memset(vp + n_real * D, 0, sizeof(float) * (n - n_real) * D);                   \
        for (int64_t t = 0; t < n_real; t++) {                                          \
            int64_t off = (int64_t)table[t / bs] * block_stride + (t % bs) * tok_stride + g * D; \
            const T *k = kc + off, *v = vc + off;                                       \
            for (int64_t d = 0; d < D; d++) kt[(t / KB * D + d) * KB + t % KB] = LOAD(k[d]); \
            _Pragma("omp simd")                                                         \
            for (int64_t d = 0; d < D; d++) vp[t * D + d] = LOAD(v[d]);                 \
        }                                                                               \
        /* Query vectors i = row * G + head in group, QV at a time (none has fewer keys \
         * than the one before), then the rest one by one. */                           \
        for (int64_t i = 0; i < nq * G;) {                                              \
            const int64_t nv = nq * G - i >= QV ? QV : 1;                               \
            const float *qv[QV];                                                        \
            float *ov[QV];                                                              \
            int64_t L[QV];                                                              \
            for (int64_t v = 0; v < nv; v++, i++) {                                     \
                const int64_t r = i / G, tv = (q_starts[c] + r) * Hq + g * G + i % G;   \
                qv[v] = q + tv * D, ov[v] = out + tv * D, L[v] = ctx + r + 1;           \
            }                                                                           \
            if (nv == QV) {                                                             \
                scores_QV(qv, kt, L[QV - 1], D, scale, sc);                             \
                softmax_pv_QV(sc, L, vp, D, ov);                                        \
            } else {                                                                    \
                scores_1(qv, kt, L[0], D, scale, sc);                                   \
                softmax_pv_1(sc, L, vp, D, ov);                                         \
            }                                                                           \
        }                                                                               \
    }                                                                                   \
    free(kt);                                                                           \
    return 0;                                                                           \
}

DEFINE_PREFILL(pdserve_prefill_attention_f32, float, LOAD_F32)
DEFINE_PREFILL(pdserve_prefill_attention_bf16, uint16_t, LOAD_BF16)
