/* y = x W^T with W held in bf16, for a CPU with no bf16 matrix unit (AVX2 and older).
 *
 * Built with cpu_attention.c into one library (kernels/cpu.py). Without native bf16,
 * torch's bf16 matmul runs a scalar path (about 10 GFLOP/s a core, at any batch); a
 * weight converted to fp32 once per call doubles the bytes a decode step streams.
 * Here each weight row is read once per call, widened to fp32 in registers (a bf16 is
 * the high half of an fp32), and used for every row of x; sums are fp32.
 *
 * Shapes: x [M, K] fp32 (row stride xs), w [N, K] bf16 contiguous, out [M, N] fp32
 * (row stride os). A call computes the output columns [n0, n1), split over num_threads
 * OpenMP threads where built with OpenMP: torch's own runtime (the same libgomp.so.1,
 * already loaded), whose threads are warm; a pool of Python threads wakes too slowly for
 * a matrix that streams in half a millisecond.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

/* From this many rows of x, four weight rows are widened once into a buffer and read
 * from there; below it, widening them again in registers for each pair of rows is
 * cheaper than the buffer's round trip (measured on Zen 3: 8 rows 118 ms against 144 ms
 * for Qwen3-0.6B's layers on 2 threads, 32 rows 347 ms against 285 ms). */
#define WIDEN_ROWS 16

static inline float widen(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* One output element the plain way (tails, and machines without AVX2). */
static float dot_bf16(const float *x, const uint16_t *w, int64_t k0, int64_t K) {
    float s = 0.f;
    for (int64_t k = k0; k < K; k++)
        s += x[k] * widen(w[k]);
    return s;
}

#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 load8(const uint16_t *w) {
    __m128i h = _mm_loadu_si128((const __m128i *)w);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* A tile of up to 2 rows of x by 4 rows of W: 8 accumulators, 4 widened weight
 * vectors and one x vector live in the 16 registers. The 4 weight rows (K * 8 bytes)
 * stay in L1/L2 while every x row pair passes over them. */
static void tile_2x4(const float *x, int64_t xs, int64_t num_m, const uint16_t *w, int64_t K,
                     float *out, int64_t os) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
    __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    const uint16_t *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;
    const float *x0 = x, *x1 = x + (num_m > 1 ? xs : 0);
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 b0 = load8(w0 + k), b1 = load8(w1 + k), b2 = load8(w2 + k), b3 = load8(w3 + k);
        __m256 v = _mm256_loadu_ps(x0 + k);
        a00 = _mm256_fmadd_ps(v, b0, a00); a01 = _mm256_fmadd_ps(v, b1, a01);
        a02 = _mm256_fmadd_ps(v, b2, a02); a03 = _mm256_fmadd_ps(v, b3, a03);
        v = _mm256_loadu_ps(x1 + k);
        a10 = _mm256_fmadd_ps(v, b0, a10); a11 = _mm256_fmadd_ps(v, b1, a11);
        a12 = _mm256_fmadd_ps(v, b2, a12); a13 = _mm256_fmadd_ps(v, b3, a13);
    }
    out[0] = hsum(a00) + dot_bf16(x0, w0, k, K);
    out[1] = hsum(a01) + dot_bf16(x0, w1, k, K);
    out[2] = hsum(a02) + dot_bf16(x0, w2, k, K);
    out[3] = hsum(a03) + dot_bf16(x0, w3, k, K);
    if (num_m > 1) {
        out[os + 0] = hsum(a10) + dot_bf16(x1, w0, k, K);
        out[os + 1] = hsum(a11) + dot_bf16(x1, w1, k, K);
        out[os + 2] = hsum(a12) + dot_bf16(x1, w2, k, K);
        out[os + 3] = hsum(a13) + dot_bf16(x1, w3, k, K);
    }
}

/* A tile of up to 3 rows of x by 4 rows of W, already widened to fp32 (wb [4, K], rows
 * ws apart, 32-byte aligned):
 * 12 accumulators and 3 x vectors in registers, the weight vectors read by the FMAs
 * from L1/L2 (3 loads a cycle feed 2 FMAs). */
static void tile_3x4(const float *x, int64_t xs, int64_t num_m, const float *wb, int64_t ws,
                     int64_t K, float *out, int64_t os) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
    __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    __m256 a20 = a00, a21 = a00, a22 = a00, a23 = a00;
    const float *w0 = wb, *w1 = wb + ws, *w2 = wb + 2 * ws, *w3 = wb + 3 * ws;
    const float *x0 = x, *x1 = x + (num_m > 1 ? xs : 0), *x2 = x + (num_m > 2 ? 2 * xs : 0);
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 v0 = _mm256_loadu_ps(x0 + k), v1 = _mm256_loadu_ps(x1 + k), v2 = _mm256_loadu_ps(x2 + k);
        __m256 b = _mm256_load_ps(w0 + k);
        a00 = _mm256_fmadd_ps(v0, b, a00); a10 = _mm256_fmadd_ps(v1, b, a10); a20 = _mm256_fmadd_ps(v2, b, a20);
        b = _mm256_load_ps(w1 + k);
        a01 = _mm256_fmadd_ps(v0, b, a01); a11 = _mm256_fmadd_ps(v1, b, a11); a21 = _mm256_fmadd_ps(v2, b, a21);
        b = _mm256_load_ps(w2 + k);
        a02 = _mm256_fmadd_ps(v0, b, a02); a12 = _mm256_fmadd_ps(v1, b, a12); a22 = _mm256_fmadd_ps(v2, b, a22);
        b = _mm256_load_ps(w3 + k);
        a03 = _mm256_fmadd_ps(v0, b, a03); a13 = _mm256_fmadd_ps(v1, b, a13); a23 = _mm256_fmadd_ps(v2, b, a23);
    }
    const __m256 acc[3][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23}};
    const float *xr[3] = {x0, x1, x2};
    for (int i = 0; i < 3 && i < num_m; i++)
        for (int j = 0; j < 4; j++) {
            float t = hsum(acc[i][j]);
            for (int64_t kk = k; kk < K; kk++)
                t += xr[i][kk] * wb[j * ws + kk];
            out[i * os + j] = t;
        }
}

/* One row of x by 8 rows of W: with a lone sequence the step is a pure stream of
 * weights, and eight rows in flight keep more loads outstanding. */
static void tile_1x8(const float *x, const uint16_t *w, int64_t K, float *out) {
    __m256 a[8];
    for (int j = 0; j < 8; j++)
        a[j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 v = _mm256_loadu_ps(x + k);
        for (int j = 0; j < 8; j++)
            a[j] = _mm256_fmadd_ps(v, load8(w + j * K + k), a[j]);
    }
    for (int j = 0; j < 8; j++)
        out[j] = hsum(a[j]) + dot_bf16(x, w + j * K, k, K);
}
#endif

static void columns(const float *x, int64_t xs, const uint16_t *w, int64_t K, float *out,
                    int64_t os, int64_t M, int64_t n0, int64_t n1) {
    int64_t n = n0;
#if defined(__AVX2__) && defined(__FMA__)
    if (M == 1) {
        for (; n + 8 <= n1; n += 8)
            tile_1x8(x, w + n * K, K, out + n);
    } else if (M < WIDEN_ROWS) {
        for (; n + 4 <= n1; n += 4)
            for (int64_t m = 0; m < M; m += 2)
                tile_2x4(x + m * xs, xs, M - m, w + n * K, K, out + m * os + n, os);
    } else {
        /* Four weight rows widened once into a buffer that stays in L1/L2 while every
         * row of x passes over it (K rounded up so each row starts 32-byte aligned). */
        int64_t Kp = (K + 7) / 8 * 8;
        float *wb = NULL;
        if (posix_memalign((void **)&wb, 64, (size_t)(4 * Kp) * sizeof(float)) == 0) {
            for (; n + 4 <= n1; n += 4) {
                for (int j = 0; j < 4; j++) {
                    const uint16_t *src = w + (n + j) * K;
                    int64_t k = 0;
                    for (; k + 8 <= K; k += 8)
                        _mm256_store_ps(wb + j * Kp + k, load8(src + k));
                    for (; k < K; k++)
                        wb[j * Kp + k] = widen(src[k]);
                }
                for (int64_t m = 0; m < M; m += 3)
                    tile_3x4(x + m * xs, xs, M - m, wb, Kp, K, out + m * os + n, os);
            }
            free(wb);
        }
    }
#endif
    for (; n < n1; n++)
        for (int64_t m = 0; m < M; m++)
            out[m * os + n] = dot_bf16(x + m * xs, w + n * K, 0, K);
}

/* Tiles of 8 columns dealt out evenly; each thread's range is whole tiles. */
void pdserve_linear_bf16(const float *x, int64_t xs, const uint16_t *w, int64_t K, float *out,
                         int64_t os, int64_t M, int64_t n0, int64_t n1, int64_t num_threads) {
    int64_t num_tiles = (n1 - n0 + 7) / 8;
    if (num_threads > num_tiles)
        num_threads = num_tiles > 0 ? num_tiles : 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < num_threads; t++) {
        int64_t a = n0 + num_tiles * t / num_threads * 8, b = n0 + num_tiles * (t + 1) / num_threads * 8;
        columns(x, xs, w, K, out, os, M, a, b < n1 ? b : n1);
    }
}

int pdserve_has_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
