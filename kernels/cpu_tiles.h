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
#endif
