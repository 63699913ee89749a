/* The CPU backend's one-pass row ops (kernels/cpu.py): RMSNorm (with the residual add),
 * per-head RMSNorm with the rotary embedding (written to a cache in fp32 or bf16), SiLU and
 * multiply, fp32 to bf16 rows, the decode step's slot mapping and advance, and prompt
 * lookup. Built with the attention kernels by kernels/cpu_build.py; kernels/portable.py is
 * the reference they are tested against. */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* x rounded to bf16 to nearest even, as torch rounds (a NaN to 0xffff, as its vector code
 * does). NOTE: the bits through memcpy, without breaking aliasing rules. */
static inline uint16_t f32_to_bf16(float x) {
    uint32_t v;
    memcpy(&v, &x, sizeof v);
    uint16_t r = (uint16_t)((v + 0x7fffu + ((v >> 16) & 1u)) >> 16);
    return ((v & 0x7fffffffu) > 0x7f800000u) ? (uint16_t)0xffff : r;
}

/* Whether every slot names a row of a cache of num_slots rows. NOTE: the callers' slots are
 * the node's own, but a wrong one would write past the cache: checked, as torch's index
 * copy checked it. */
static int slots_inside(const int64_t *slots, int64_t T, int64_t num_slots) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return 0;
    return 1;
}

#define STORE_F32(x) (x)
#define STORE_BF16(x) f32_to_bf16(x)

/* One pass each over rows whose last dimension is contiguous (row strides in elements). */

/* out[t] = rms_norm(x[t] (+ res[t])) * w; with res, x + res is also written to res_out.
 * x, res: [T, H] (row strides xs, rs); out, res_out: [T, H] contiguous. */
void pdserve_rms_norm_f32(const float *x, int64_t xs, const float *res, int64_t rs,
                          const float *w, float *out, float *res_out, int64_t T, int64_t H,
                          float eps, int64_t num_threads) {
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if(num_threads > 1)")
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
 * x: [T, nh, D] fp32 (token stride xs, heads contiguous); cos_sin: [max_pos, 2, D] (halves
 * repeated); positions: [T] int64. out: [T, nh, D] contiguous, or, given slots [T] int64,
 * token t's row goes to out + slots[t] * nh * D (a contiguous cache of num_slots rows), in
 * fp32 or rounded to bf16 (the cache's dtype: the rotation itself is fp32 either way).
 * Returns 0, or -1 (nothing written) where a slot is outside the cache. */
#define DEFINE_NORM_ROPE(NAME, T_OUT, STORE)                                                \
int NAME(const float *x, int64_t xs, const float *w, const float *cos_sin,                  \
         const int64_t *positions, T_OUT *out, const int64_t *slots, int64_t num_slots,      \
         int64_t T, int64_t nh, int64_t D, float eps, int64_t num_threads) {                \
    if (slots && !slots_inside(slots, T, num_slots)) return -1;                             \
    int64_t half = D / 2;                                                                   \
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if(num_threads > 1)")\
    for (int64_t t = 0; t < T; t++) {                                                       \
        const float *c = cos_sin + positions[t] * 2 * D, *s = c + D;                        \
        T_OUT *ot = out + (slots ? slots[t] : t) * nh * D;                                  \
        for (int64_t h = 0; h < nh; h++) {                                                  \
            const float *xh = x + t * xs + h * D;                                           \
            T_OUT *oh = ot + h * D;                                                         \
            float ss = 0.0f;                                                                \
            _Pragma("omp simd reduction(+:ss)")                                             \
            for (int64_t d = 0; d < D; d++) ss += xh[d] * xh[d];                            \
            float inv = 1.0f / sqrtf(ss / (float)D + eps);                                  \
            _Pragma("omp simd")                                                             \
            for (int64_t d = 0; d < half; d++) {                                            \
                float a = w[d] * (xh[d] * inv), b = w[d + half] * (xh[d + half] * inv);     \
                oh[d] = STORE(a * c[d] - b * s[d]);                                         \
                oh[d + half] = STORE(b * c[d + half] + a * s[d + half]);                    \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
    return 0;                                                                               \
}

DEFINE_NORM_ROPE(pdserve_norm_rope_f32, float, STORE_F32)
DEFINE_NORM_ROPE(pdserve_norm_rope_bf16, uint16_t, STORE_BF16)

/* out[t] = silu(gate[t]) * up[t]; gate_up: [T, 2I] (row stride gs), out: [T, I]. */
void pdserve_silu_mul_f32(const float *gate_up, int64_t gs, float *out, int64_t T, int64_t I,
                          int64_t num_threads) {
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if(num_threads > 1)")
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * gs, *u = g + I;
        float *o = out + t * I;
        _Pragma("omp simd")
        for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* out [P, K] bf16 = x [M, K] fp32 (row stride xs), rounded as f32_to_bf16, rows M..P-1
 * zeros (the tiles' padding). */
void pdserve_to_bf16_rows(const float *x, int64_t xs, uint16_t *out, int64_t M, int64_t K,
                          int64_t P, int64_t num_threads) {
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if(num_threads > 1)")
    for (int64_t t = 0; t < P; t++) {
        uint16_t *o = out + t * K;
        if (t >= M) {
            memset(o, 0, sizeof(uint16_t) * K);
            continue;
        }
        const float *xt = x + t * xs;
        _Pragma("omp simd")
        for (int64_t k = 0; k < K; k++) o[k] = f32_to_bf16(xt[k]);
    }
}

/* dst row slots[t] = src row t: rows of `row` floats; src row stride ss, dst num_slots
 * contiguous rows (fp32, or rounded to bf16 as f32_to_bf16). Returns 0, or -1 (nothing
 * written) where a slot is outside dst. */
int pdserve_scatter_rows_f32(const float *src, int64_t ss, float *dst, const int64_t *slots,
                             int64_t num_slots, int64_t T, int64_t row) {
    if (!slots_inside(slots, T, num_slots)) return -1;
    for (int64_t t = 0; t < T; t++)
        memcpy(dst + slots[t] * row, src + t * ss, sizeof(float) * row);
    return 0;
}

int pdserve_scatter_rows_bf16(const float *src, int64_t ss, uint16_t *dst,
                              const int64_t *slots, int64_t num_slots, int64_t T, int64_t row) {
    if (!slots_inside(slots, T, num_slots)) return -1;
    for (int64_t t = 0; t < T; t++) {
        const float *s = src + t * ss;
        uint16_t *d = dst + slots[t] * row;
        _Pragma("omp simd")
        for (int64_t k = 0; k < row; k++) d[k] = f32_to_bf16(s[k]);
    }
    return 0;
}

/* The slot of each sequence's current token (position seq_lens[b] - 1): out [B] int64.
 * tables [B, bt_stride] int32 with W usable entries; seq_lens [B] int32. */
void pdserve_slot_mapping(const int32_t *seq_lens, const int32_t *tables, int64_t bt_stride,
                          int64_t W, int64_t bs, int64_t *out, int64_t B) {
    for (int64_t b = 0; b < B; b++) {
        /* floor division and modulo as the portable op (a padding row has length 0) */
        const int64_t pos = seq_lens[b] - 1, r = ((pos % bs) + bs) % bs;
        int64_t i = (pos - r) / bs;
        i = i < 0 ? 0 : (i >= W ? W - 1 : i);
        out[b] = (int64_t)tables[b * bt_stride + i] * bs + r;
    }
}

/* After a decode step's sampling, each row b in [0, B): its sampled token becomes its next
 * input, written first at position seq_lens[b] of its history row (where history is not
 * NULL: [B, hist_stride] int32, hist_width usable; a position past it is skipped), and its
 * length grows by step_inc[b] (0 on a padding row). */
void pdserve_advance_step(int64_t *input_ids, const int64_t *sampled, int32_t *seq_lens,
                          const int32_t *step_inc, int32_t *history, int64_t hist_stride,
                          int64_t hist_width, int64_t B) {
    for (int64_t b = 0; b < B; b++) {
        const int64_t pos = seq_lens[b];
        if (history != NULL && pos >= 0 && pos < hist_width)
            history[b * hist_stride + pos] = (int32_t)sampled[b];
        input_ids[b] = sampled[b];
        seq_lens[b] += step_inc[b];
    }
}

/* Prompt lookup (kernels/portable.py prompt_lookup, the reference): for each row b of rows
 * [n, stride] int32 (its tokens [0, lens[b]), at most width of them read), the last m
 * tokens (m from max_n down to min_n, the first found wins) looked for at their latest
 * earlier place ending before the last token; the tokens after it are the drafts, those
 * up to the row's end repeated past it. drafts [n, k] int64, -1 where none is found. */
void pdserve_prompt_lookup(const int32_t *rows, int64_t stride, int64_t width,
                           const int32_t *lens, int64_t n, int64_t k, int64_t min_n,
                           int64_t max_n, int64_t *drafts) {
    for (int64_t b = 0; b < n; b++) {
        const int32_t *r = rows + b * stride;
        const int64_t len = lens[b] < width ? lens[b] : width;
        int64_t start = -1;
        for (int64_t m = max_n; m >= min_n && start < 0; m--) {
            if (width <= m || len - m - 1 < 0) continue;
            const int32_t *suffix = r + len - m;
            /* windows [p, p + m) with p <= len - m - 1: a token follows each */
            for (int64_t p = len - m - 1; p >= 0; p--) {
                if (memcmp(r + p, suffix, (size_t)m * sizeof *r) == 0) {
                    start = p + m;
                    break;
                }
            }
        }
        int64_t *out = drafts + b * k;
        const int64_t period = len - start > 1 ? len - start : 1;
        for (int64_t j = 0; j < k; j++) {
            if (start < 0) {
                out[j] = -1;
                continue;
            }
            int64_t pos = start + j % period;
            pos = pos < 0 ? 0 : (pos >= width ? width - 1 : pos);
            out[j] = r[pos];
        }
    }
}
