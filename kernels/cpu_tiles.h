/* The AMX tile configuration cpu_linear_vnni.c's matmul and cpu_attention_tiles.c's attention
 * share: C tiles 0-3 (16 rows of 16 fp32), A tiles 4-5 (16 rows of 32 bf16), B tiles 6-7 (16
 * input pairs by 16 columns, 64 bytes a row). Included where AMX-TILE and AMX-BF16 are
 * built. NOTE: a configuration is per thread: each thread that runs tiles sets it, and
 * releases the tiles when done. */
#ifndef PDSERVE_CPU_TILES_H
#define PDSERVE_CPU_TILES_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static inline void configure_tiles(void) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* c [32, 32] fp32 (row stride cs) = a [32, K] bf16 (row stride as) times 32 columns in pair
 * layout, two blocks of 16 (b0, b1: [K / 2, 16, 2] each): C tiles 0-3 += A tiles 4-5 (rows
 * 0-15, 16-31) by B tiles 6-7 (columns 0-15, 16-31), 32 inputs a step, each A and B tile
 * loaded once and used twice. K a multiple of 32; strides in elements. */
static inline void tiles_32x32(const uint16_t *a, int64_t as, const uint16_t *b0,
                               const uint16_t *b1, int64_t K, float *c, int64_t cs) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < K; k += 32) {
        _tile_loadd(4, a + k, as * 2);
        _tile_loadd(5, a + 16 * as + k, as * 2);
        _tile_loadd(6, b0 + k * 16, 64);
        _tile_loadd(7, b1 + k * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, cs * 4);
    _tile_stored(1, c + 16, cs * 4);
    _tile_stored(2, c + 16 * cs, cs * 4);
    _tile_stored(3, c + 16 * cs + 16, cs * 4);
}
#endif
