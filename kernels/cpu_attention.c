/* Paged decode attention for CPU: one query per sequence, reading K and V in
 * place from the block cache (no gather into a dense copy).
 *
 * Built by kernels/cpu.py with the system C compiler (-O3 -march=native) and
 * called through ctypes; plain C with a C ABI, so building it needs no torch
 * headers. kernels/portable.py is the reference it is tested against.
 *
 * Shapes (element strides for the caches; the last dimension is contiguous):
 *   q, out       [B, Hq, D] fp32, contiguous
 *   k, v cache   [num_blocks, block_size, Hk, D] (fp32 or bf16)
 *   block_tables [B, bt_stride] int32;  seq_lens [B] int32 (tokens, >= 1)
 * Query head h reads KV head h / (Hq / Hk).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* One sequence: its Hq query heads over n tokens. A token's K (and V) row holds
 * every KV head ([Hk, D], contiguous), so it is read once, by all query heads.
 * scores: scratch [Hq, n]; acc: scratch [Hq, D]. */
#define DEFINE_ATTEND(NAME, T, LOAD)                                                      \
static void NAME(const float *q, const T *kc, const T *vc, const int32_t *table,        \
                 int64_t n, int64_t Hq, int64_t G, int64_t D, int64_t bs,                \
                 int64_t block_stride, int64_t tok_stride, float scale, float *scores,   \
                 float *acc, float *out) {                                               \
    const T *k = kc, *v = vc;                                                            \
    for (int64_t t = 0; t < n; t++) {                                                    \
        if (t % bs == 0) k = kc + (int64_t)table[t / bs] * block_stride;                 \
        else k += tok_stride;                                                            \
        for (int64_t h = 0; h < Hq; h++) {                                               \
            const float *qh = q + h * D;                                                 \
            const T *kh = k + (h / G) * D;                                               \
            float s = 0.0f;                                                              \
            _Pragma("omp simd reduction(+:s)")                                          \
            for (int64_t d = 0; d < D; d++) s += qh[d] * LOAD(kh[d]);                    \
            scores[h * n + t] = s * scale;                                               \
        }                                                                                \
    }                                                                                    \
    for (int64_t h = 0; h < Hq; h++) {                                                   \
        float *sh = scores + h * n, m = sh[0], sum = 0.0f;                               \
        for (int64_t t = 1; t < n; t++) m = sh[t] > m ? sh[t] : m;                       \
        _Pragma("omp simd reduction(+:sum)")                                            \
        for (int64_t t = 0; t < n; t++) { sh[t] = expf(sh[t] - m); sum += sh[t]; }       \
        float inv = 1.0f / sum;                                                          \
        for (int64_t t = 0; t < n; t++) sh[t] *= inv;                                    \
    }                                                                                    \
    memset(acc, 0, sizeof(float) * Hq * D);                                              \
    for (int64_t t = 0; t < n; t++) {                                                    \
        if (t % bs == 0) v = vc + (int64_t)table[t / bs] * block_stride;                 \
        else v += tok_stride;                                                            \
        for (int64_t h = 0; h < Hq; h++) {                                               \
            float p = scores[h * n + t], *a = acc + h * D;                               \
            const T *vh = v + (h / G) * D;                                               \
            _Pragma("omp simd")                                                          \
            for (int64_t d = 0; d < D; d++) a[d] += p * LOAD(vh[d]);                     \
        }                                                                                \
    }                                                                                    \
    memcpy(out, acc, sizeof(float) * Hq * D);                                            \
}

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)
DEFINE_ATTEND(attend_f32, float, LOAD_F32)
DEFINE_ATTEND(attend_bf16, uint16_t, LOAD_BF16)

/* Returns 0, or -1 when scratch memory could not be had. */
#define DEFINE_DECODE(NAME, T, ATTEND)                                                   \
int NAME(const float *q, const T *kc, const T *vc, const int32_t *block_tables,         \
         int64_t bt_stride, const int32_t *seq_lens, float *out, int64_t B, int64_t Hq,  \
         int64_t Hk, int64_t D, int64_t bs, int64_t block_stride, int64_t tok_stride,    \
         float scale) {                                                                  \
    int64_t max_n = 1;                                                                   \
    for (int64_t b = 0; b < B; b++) max_n = seq_lens[b] > max_n ? seq_lens[b] : max_n;  \
    float *scratch = malloc(sizeof(float) * Hq * (max_n + D));                           \
    if (!scratch) return -1;                                                             \
    for (int64_t b = 0; b < B; b++) {                                                    \
        int64_t n = seq_lens[b] < 1 ? 1 : seq_lens[b];                                   \
        ATTEND(q + b * Hq * D, kc, vc, block_tables + b * bt_stride, n, Hq, Hq / Hk, D,  \
               bs, block_stride, tok_stride, scale, scratch, scratch + Hq * max_n,       \
               out + b * Hq * D);                                                        \
    }                                                                                    \
    free(scratch);                                                                       \
    return 0;                                                                            \
}

DEFINE_DECODE(pdserve_decode_attention_f32, float, attend_f32)
DEFINE_DECODE(pdserve_decode_attention_bf16, uint16_t, attend_bf16)

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
#define JU 4    /* keys in flight per output tile (KB must be a multiple) */

/* Scores of two query vectors (qa over La keys, qb over Lb >= La) against packed K
 * tiles, into sa and sb: each K load feeds both, and the 2 x KB sums are independent
 * chains of FMAs, held in registers. */
static void scores2(const float *qa, const float *qb, const float *kt, int64_t Lb, int64_t D,
                    float scale, float *sa, float *sb) {
    for (int64_t j0 = 0; j0 < Lb; j0 += KB) {
        float s0[KB] = {0}, s1[KB] = {0};
        for (int64_t d = 0; d < D; d++) {
            const float a = qa[d], b = qb[d], *kd = kt + (j0 * D + d * KB);
            _Pragma("omp simd")
            for (int64_t j = 0; j < KB; j++) { s0[j] += a * kd[j]; s1[j] += b * kd[j]; }
        }
        _Pragma("omp simd")
        for (int64_t j = 0; j < KB; j++) { sa[j0 + j] = s0[j] * scale; sb[j0 + j] = s1[j] * scale; }
    }
}

/* o[D] = softmax(sc[0:L]) @ V[0:L]; sc is overwritten. vp: [>= round_up(L, JU), D],
 * rows past the keys zero. */
static void softmax_pv(float *sc, int64_t L, const float *vp, int64_t D, float *o) {
    float m = sc[0], sum = 0.0f;
    _Pragma("omp simd reduction(max:m)")
    for (int64_t j = 0; j < L; j++) m = sc[j] > m ? sc[j] : m;
    _Pragma("omp simd reduction(+:sum)")
    for (int64_t j = 0; j < L; j++) { sc[j] = expf(sc[j] - m); sum += sc[j]; }
    for (int64_t j = L; j < (L + JU - 1) / JU * JU; j++) sc[j] = 0.0f;
    const float inv = 1.0f / sum;
    for (int64_t d0 = 0; d0 < D; d0 += DB) {   /* DB outputs in registers */
        float a[JU][DB] = {{0}};               /* JU independent sums: no FMA latency chain */
        for (int64_t j = 0; j < L; j += JU) {
            for (int64_t u = 0; u < JU; u++) {
                const float p = sc[j + u], *vj = vp + (j + u) * D + d0;
                _Pragma("omp simd")
                for (int64_t d = 0; d < DB; d++) a[u][d] += p * vj[d];
            }
        }
        for (int64_t u = 1; u < JU; u++)
            for (int64_t d = 0; d < DB; d++) a[0][d] += a[u][d];
        _Pragma("omp simd")
        for (int64_t d = 0; d < DB; d++) o[d0 + d] = a[0][d] * inv;
    }
}

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
    float *kt = malloc(sizeof(float) * (2 * D * max_n + 2 * max_n));                    \
    if (!kt) return -1;                                                                 \
    float *vp = kt + D * max_n, *sa = vp + D * max_n, *sb = sa + max_n;                 \
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
        /* Query vectors i = row * G + head in group, two at a time (the second never   \
         * has fewer keys); an odd last one is paired with itself. */                    \
        for (int64_t i = 0; i < nq * G; i += 2) {                                       \
            const int64_t i2 = i + 1 < nq * G ? i + 1 : i;                              \
            const int64_t ra = i / G, rb = i2 / G, La = ctx + ra + 1, Lb = ctx + rb + 1; \
            const int64_t ta = (q_starts[c] + ra) * Hq + g * G + i % G;                 \
            const int64_t tb = (q_starts[c] + rb) * Hq + g * G + i2 % G;                \
            scores2(q + ta * D, q + tb * D, kt, Lb, D, scale, sa, sb);                   \
            softmax_pv(sa, La, vp, D, out + ta * D);                                    \
            if (i2 != i) softmax_pv(sb, Lb, vp, D, out + tb * D);                       \
        }                                                                               \
    }                                                                                   \
    free(kt);                                                                           \
    return 0;                                                                           \
}

DEFINE_PREFILL(pdserve_prefill_attention_f32, float, LOAD_F32)
DEFINE_PREFILL(pdserve_prefill_attention_bf16, uint16_t, LOAD_BF16)

/* ---- fp32 elementwise ops, one pass each over rows whose last dimension is
 * contiguous (row strides in elements). ---- */

/* out[t] = rms_norm(x[t] (+ res[t])) * w; with res, x + res is also written to res_out.
 * x, res: [T, H] (row strides xs, rs); out, res_out: [T, H] contiguous. */
void pdserve_rms_norm_f32(const float *x, int64_t xs, const float *res, int64_t rs,
                          const float *w, float *out, float *res_out, int64_t T, int64_t H,
                          float eps) {
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * xs;
        float *ot = out + t * H, ss = 0.0f;
        if (res) {
            const float *rt = res + t * rs;
            float *st = res_out + t * H;
            _Pragma("omp simd reduction(+:ss)")
            for (int64_t h = 0; h < H; h++) { st[h] = xt[h] + rt[h]; ss += st[h] * st[h]; }
            xt = st;
        } else {
            _Pragma("omp simd reduction(+:ss)")
            for (int64_t h = 0; h < H; h++) ss += xt[h] * xt[h];
        }
        float inv = 1.0f / sqrtf(ss / (float)H + eps);
        _Pragma("omp simd")
        for (int64_t h = 0; h < H; h++) ot[h] = w[h] * (xt[h] * inv);
    }
}

/* Per-head RMSNorm, then the rotary embedding at each token's position.
 * x: [T, nh, D] (token stride xs, heads contiguous); out: [T, nh, D] contiguous;
 * cos_sin: [max_pos, 2, D] (halves repeated); positions: [T] int64. */
void pdserve_norm_rope_f32(const float *x, int64_t xs, const float *w, const float *cos_sin,
                           const int64_t *positions, float *out, int64_t T, int64_t nh,
                           int64_t D, float eps) {
    int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_sin + positions[t] * 2 * D, *s = c + D;
        for (int64_t h = 0; h < nh; h++) {
            const float *xh = x + t * xs + h * D;
            float *oh = out + (t * nh + h) * D, ss = 0.0f;
            _Pragma("omp simd reduction(+:ss)")
            for (int64_t d = 0; d < D; d++) ss += xh[d] * xh[d];
            float inv = 1.0f / sqrtf(ss / (float)D + eps);
            _Pragma("omp simd")
            for (int64_t d = 0; d < half; d++) {
                float a = w[d] * (xh[d] * inv), b = w[d + half] * (xh[d + half] * inv);
                oh[d] = a * c[d] - b * s[d];
                oh[d + half] = b * c[d + half] + a * s[d + half];
            }
        }
    }
}

/* out[t] = silu(gate[t]) * up[t]; gate_up: [T, 2I] (row stride gs), out: [T, I]. */
void pdserve_silu_mul_f32(const float *gate_up, int64_t gs, float *out, int64_t T, int64_t I) {
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * gs, *u = g + I;
        float *o = out + t * I;
        _Pragma("omp simd")
        for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
