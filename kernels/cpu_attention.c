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
