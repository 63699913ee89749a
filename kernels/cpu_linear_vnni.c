/* y = x W^T in bf16 on a CPU with bf16 dot-product instructions (AVX512-BF16) and bf16
 * tiles (AMX-BF16), over one weight layout that both read:
 *
 *   wp [N / 16, K / 2, 16, 2]: for each block of 16 output columns, for each pair of
 *   inputs (k, k + 1), the 16 columns' two weights side by side (32 bf16, 64 bytes).
 *
 * A row of 64 bytes is what vdpbf16ps multiplies with a broadcast pair of x, giving 16
 * outputs at once with no horizontal sum; 16 such rows are one AMX B tile (32 inputs by
 * 16 columns). So a decode step (a few rows of x) streams each weight byte once through
 * the vector unit, and a larger batch runs the same bytes through the tile unit.
 *
 * Shapes: x [M, K] bf16 (fp32 for the dot product; row stride xs elements), out [M, N] fp32
 * (row stride os), K a multiple of 32 and N of 16 (the caller checks); sums are fp32. A call
 * computes the column blocks [b0, b1), split over num_threads OpenMP threads where built
 * with OpenMP.
 * Without the instructions the functions are absent from pdserve_vnni_paths() and the
 * caller never calls them.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512BF16__) || (defined(__AMX_TILE__) && defined(__AMX_BF16__))
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAS_AMX 1
#include "cpu_tiles.h"
#endif

#define PATH_DOT 1 /* vdpbf16ps: pdserve_linear_vnni_dot */
#define PATH_AMX 2 /* AMX-BF16: pdserve_linear_vnni_amx */

int pdserve_vnni_paths(void) {
    int paths = 0;
#if defined(__AVX512BF16__)
    paths |= PATH_DOT;
#endif
#ifdef HAS_AMX
    paths |= PATH_AMX;
#endif
    return paths;
}

#if defined(__AVX512BF16__)
/* Rows of 64 bytes each stream is prefetched ahead: the hardware prefetcher alone kept a
 * step at 25 GB/s; 32 ahead took it to 29 (Xeon with AMX, 2 threads; 8 ahead 28.6, 128 ahead
 * 26.4). */
#define AHEAD 32

/* DOT_TILE(name, R, B, IS_PREFETCH): up to R rows of x by up to B column blocks, R * B
 * accumulators. Each weight row (64 bytes) is loaded once and multiplied with every row's
 * pair of x (a 4-byte broadcast). Called with constant num_m and num_b where the tile is
 * whole (or, for a decode step's rows, one constant per count), so the loops unroll and only
 * the accumulators in use take registers (a 4 x 8 tile with 1 row live would spill). */
#define DOT_TILE(name, R, B, IS_PREFETCH)                                                   \
    static inline __attribute__((always_inline)) void name(                               \
        const uint16_t *x, int64_t xs, int64_t num_m, const uint16_t *wp, int64_t K,       \
        int64_t num_b, float *out, int64_t os) {                                           \
        const int64_t num_pairs = K / 2, block = num_pairs * 32;                           \
        __m512 acc[R][B];                                                                  \
        for (int i = 0; i < R; i++)                                                        \
            for (int j = 0; j < B; j++)                                                    \
                acc[i][j] = _mm512_setzero_ps();                                           \
        const uint32_t *xr[R];                                                             \
        for (int i = 0; i < R; i++)                                                        \
            xr[i] = (const uint32_t *)(x + (i < num_m ? i : 0) * xs);                      \
        for (int64_t p = 0; p < num_pairs; p++) {                                          \
            __m512bh w[B];                                                                 \
            for (int j = 0; j < B; j++)                                                    \
                if (j < num_b) {                                                           \
                    w[j] = (__m512bh)_mm512_loadu_si512(wp + j * block + p * 32);          \
                    /* NOTE: a prefetch never faults, past the weight's end included */    \
                    if (IS_PREFETCH)                                                       \
                        _mm_prefetch((const char *)(wp + j * block + (p + AHEAD) * 32),    \
                                     _MM_HINT_T0);                                         \
                }                                                                          \
            for (int i = 0; i < R; i++) {                                                  \
                if (i >= num_m)                                                            \
                    break;                                                                 \
                __m512bh v = (__m512bh)_mm512_set1_epi32((int)xr[i][p]);                   \
                for (int j = 0; j < B; j++)                                                \
                    if (j < num_b)                                                         \
                        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], v, w[j]);                  \
            }                                                                              \
        }                                                                                  \
        for (int i = 0; i < num_m && i < R; i++)                                           \
            for (int j = 0; j < num_b && j < B; j++)                                       \
                _mm512_storeu_ps(out + i * os + j * 16, acc[i][j]);                        \
    }

/* A decode step's rows (1-4) by NB column blocks, streamed from memory: prefetched.
 * NOTE: 4, not 8: 4 rows by 8 blocks are all 32 registers as accumulators, and spilled
 * (Qwen3-0.6B's lm_head, 4 rows, two EPYC cores: 5.6 -> 4.8 ms; 1 row, 8 streams a
 * thread: 0-6% slower than 4, the layers' and the lm_head's alike). */
#define NB 4
DOT_TILE(tile_dot, 4, NB, 1)
/* More rows (a CPU without tiles): WR rows of x by WB column blocks a pass (8 * 3 + 3 + 1
 * of 32 registers), so the panel of WB blocks (96 KB at K = 1,024) is read from L2 once per
 * WR rows, each weight row multiplied with WR pairs of x. */
#define WR 8
#define WB 3
DOT_TILE(wide_dot, WR, WB, 0)
/* The same, prefetched, for a decode step's rows (5 to STREAM_MAX_ROWS): with so few passes
 * over a panel its weights come from memory, as the few rows' do (Qwen3-0.6B's gate_up and
 * lm_head at 8 and 64 rows, two EPYC cores: ~4% sooner, alternated builds; no change at
 * 1,024 rows, where the panel is read from L2 128 times). */
#define STREAM_MAX_ROWS 64
DOT_TILE(wide_stream, WR, WB, 1)

/* The tiles of a few rows, one constant row count each (see DOT_TILE). */
static void few_dot(const uint16_t *x, int64_t xs, int64_t num_m, const uint16_t *wp,
                    int64_t K, int64_t num_b, float *out, int64_t os) {
    if (num_b != NB) {
        tile_dot(x, xs, num_m, wp, K, num_b, out, os);
        return;
    }
    switch (num_m) {
    case 1:
        tile_dot(x, xs, 1, wp, K, NB, out, os);
        break;
    case 2:
        tile_dot(x, xs, 2, wp, K, NB, out, os);
        break;
    case 3:
        tile_dot(x, xs, 3, wp, K, NB, out, os);
        break;
    case 4:
        tile_dot(x, xs, 4, wp, K, NB, out, os);
        break;
    default: /* NOTE: not reached (blocks_dot asks 1-4 rows); the tile stores 4 at most */
        tile_dot(x, xs, num_m, wp, K, NB, out, os);
    }
}

static void wide_dot_full(const uint16_t *x, int64_t xs, const uint16_t *wp, int64_t K,
                          float *out, int64_t os, int is_streamed) {
    if (is_streamed)
        wide_stream(x, xs, WR, wp, K, WB, out, os);
    else
        wide_dot(x, xs, WR, wp, K, WB, out, os);
}

static void wide_dot_part(const uint16_t *x, int64_t xs, int64_t num_m, const uint16_t *wp,
                          int64_t K, int64_t num_b, float *out, int64_t os, int is_streamed) {
    if (is_streamed)
        wide_stream(x, xs, num_m, wp, K, num_b, out, os);
    else
        wide_dot(x, xs, num_m, wp, K, num_b, out, os);
}

static void blocks_dot(const uint16_t *x, int64_t xs, const uint16_t *wp, int64_t K, float *out,
                       int64_t os, int64_t M, int64_t b0, int64_t b1) {
    const int64_t block = K * 16;
    if (M > 4) {
        for (int64_t b = b0; b < b1; b += WB) {
            int64_t num_b = b1 - b < WB ? b1 - b : WB;
            for (int64_t m = 0; m < M; m += WR) {
                int64_t num_m = M - m < WR ? M - m : WR;
                if (num_m == WR && num_b == WB)
                    wide_dot_full(x + m * xs, xs, wp + b * block, K, out + m * os + b * 16, os,
                                  M <= STREAM_MAX_ROWS);
                else
                    wide_dot_part(x + m * xs, xs, num_m, wp + b * block, K, num_b,
                                  out + m * os + b * 16, os, M <= STREAM_MAX_ROWS);
            }
        }
        return;
    }
    for (int64_t b = b0; b < b1 && M > 0; b += NB) {
        int64_t num_b = b1 - b < NB ? b1 - b : NB;
        few_dot(x, xs, M, wp + b * block, K, num_b, out + b * 16, os);
    }
}
#endif

/* x here is fp32 [M, K] (row stride xs): rounded to bf16 once, to nearest even as torch
 * rounds, before the threads start. Returns -1 where that copy cannot be had. */
int pdserve_linear_vnni_dot(const float *x, int64_t xs, const uint16_t *wp, int64_t K,
                            float *out, int64_t os, int64_t M, int64_t b0, int64_t b1,
                            int64_t num_threads) {
#if defined(__AVX512BF16__)
    uint16_t *xb = NULL;
    if (posix_memalign((void **)&xb, 64, (size_t)(M * K) * sizeof(uint16_t)) != 0)
        return -1;
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k += 16)  /* K is a multiple of 32 */
            _mm256_storeu_si256((__m256i *)(xb + m * K + k),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + m * xs + k)));
    int64_t num_blocks = b1 - b0;
    if (num_threads > num_blocks)
        num_threads = num_blocks > 0 ? num_blocks : 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < num_threads; t++)
        blocks_dot(xb, K, wp, K, out, os, M, b0 + num_blocks * t / num_threads,
                   b0 + num_blocks * (t + 1) / num_threads);
    free(xb);
    return 0;
#else
    (void)x, (void)xs, (void)wp, (void)K, (void)out, (void)os, (void)M, (void)b0, (void)b1;
    (void)num_threads;
    return -1;
#endif
}

#ifdef HAS_AMX
/* Rows of x a block of them holds, in bytes: every pair of column blocks runs one block of
 * x's rows (M a multiple of 32) before the next block, so both x's block and the pair's
 * weights (32 columns by K) stay in L2 (1 MiB: 12-20% under no blocking at 1,024 rows of
 * Qwen3-0.6B's layers, 2 threads, Xeon with AMX; 256 and 512 KiB no better). */
#define X_BLOCK_BYTES (1024 * 1024)

/* Pairs of column blocks, a block of x's rows at a time. */
static void blocks_amx(const uint16_t *x, int64_t xs, const uint16_t *wp, int64_t K, float *out,
                       int64_t os, int64_t M, int64_t b0, int64_t b1) {
    const int64_t block = K * 16;
    int64_t mc = X_BLOCK_BYTES / (2 * K) / 32 * 32;
    if (mc < 32)
        mc = 32;
    configure_tiles();
    for (int64_t m0 = 0; m0 < M; m0 += mc) {
        int64_t m1 = m0 + mc < M ? m0 + mc : M;
        for (int64_t b = b0; b + 2 <= b1; b += 2)
            for (int64_t m = m0; m < m1; m += 32)
                tiles_32x32(x + m * xs, xs, wp + b * block, wp + (b + 1) * block, K,
                            out + m * os + b * 16, os);
    }
    _tile_release();
}
#endif

/* 0 when this process may use the tiles (Linux asks each process to request them). */
int pdserve_amx_init(void) {
#ifdef HAS_AMX
    /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA */
    return (int)syscall(SYS_arch_prctl, 0x1023, 18);
#else
    return -1;
#endif
}

/* M a multiple of 32 and the block range of even length (the caller pads and checks). */
void pdserve_linear_vnni_amx(const uint16_t *x, int64_t xs, const uint16_t *wp, int64_t K,
                             float *out, int64_t os, int64_t M, int64_t b0, int64_t b1,
                             int64_t num_threads) {
#ifdef HAS_AMX
    int64_t num_pairs = (b1 - b0) / 2;
    if (num_threads > num_pairs)
        num_threads = num_pairs > 0 ? num_pairs : 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < num_threads; t++)
        blocks_amx(x, xs, wp, K, out, os, M, b0 + 2 * (num_pairs * t / num_threads),
                   b0 + 2 * (num_pairs * (t + 1) / num_threads));
#else
    (void)x, (void)xs, (void)wp, (void)K, (void)out, (void)os, (void)M, (void)b0, (void)b1;
    (void)num_threads;
#endif
}
