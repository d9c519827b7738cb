// AMX-BF16 building blocks shared by the fused MoE kernel (fused_moe_amx.h) and the dense
// linear kernel (packed_linear.cpp): the Linux permission request, the tile configuration and
// the 2 x 2-tile tdpbf16ps block on a packed weight.
//
// Tiles (palette 1): C0..C3 = tmm0..3, 16 rows x 16 float32; A0, A1 = tmm4, 5, 16 rows x 32
// bf16 (row-major activations, a row stride `lda` elements); B0, B1 = tmm6, 7, 16 k pairs x 16
// columns x 2 bf16: exactly 16 rows of a packed weight panel [K / 2][16][2] (the vdpbf16ps
// layout), stride 64 bytes. Per 32 k: two A loads, two B loads, four tdpbf16ps. An A tile
// reads 32 k of 16 rows (fewer in a row tail configured by `amx_tile_config`): callers pad K
// to a multiple of 32.
//
// Each output row of tdpbf16ps depends on its own A row only, and sums the k tiles in order
// k = 0, 32, 64, ...; so a row's result does not depend on the number of rows. Within one tile
// the hardware's order of the 32 products is fixed (not documented; tested). Tile state is per
// thread: load the configuration (`amx_tile_config`) before a run of blocks, release it after.
#pragma once

#include "fused_moe_common.h"

#if BATCHGEN_HAVE_AMX
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#if BATCHGEN_HAVE_AMX
#define BATCHGEN_AMX_TARGET __attribute__((target("avx512f,avx512bf16,amx-tile,amx-bf16")))

struct AmxTileConfig {  // the 64-byte operand of ldtilecfg
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];  // bytes per row of each tile
  uint8_t rows[16];
} __attribute__((packed));

// Loads the tile configuration into this thread's tile state: 8 tiles of 64 bytes a row, 16
// rows each except the A and C tiles of a row tail: C0, C1, A0 get `rows_lo` rows and C2, C3,
// A1 `rows_hi` (1 .. 16), so a block of 1 .. 31 rows reads and writes only its rows (no zero
// padding in memory; tdpbf16ps computes the configured rows only).
BATCHGEN_AMX_TARGET inline void amx_tile_config(int rows_lo = 16, int rows_hi = 16) {
  AmxTileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = static_cast<uint8_t>(rows_lo);
  cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = static_cast<uint8_t>(rows_hi);
  _tile_loadconfig(&cfg);
}

// Releases this thread's tile state. A function of its own with the AMX target: a caller
// compiled without AMX in its target (an OpenMP region under -march=native on a CPU without
// AMX, e.g. AMD Zen 4) cannot inline the `_tile_release` intrinsic itself.
BATCHGEN_AMX_TARGET inline void amx_tile_release() { _tile_release(); }

// MT x NT tiles of C = A . B over k_size (a multiple of 32) into cbuf [4][16][16] float32
// (tile 2 tm + tn at cbuf + 256 (2 tm + tn)): rows a .. a + 16 MT (stride lda elements), panels
// b0 and b0 + k_size * 16 (packed [K / 2][16][2] each).
template <int MT, int NT>
BATCHGEN_AMX_TARGET inline void amx_block(const uint16_t* a, int64_t lda, int64_t k_size,
                                          const uint16_t* b0, float* cbuf) {
  const uint16_t* b1 = b0 + k_size * kPanel;
  const uint16_t* a1 = a + 16 * lda;
  const int64_t stride = lda * 2;  // bytes per activation row
  _tile_zero(0);
  if constexpr (NT == 2) _tile_zero(1);
  if constexpr (MT == 2) _tile_zero(2);
  if constexpr (MT == 2 && NT == 2) _tile_zero(3);
  for (int64_t k = 0; k < k_size; k += 32) {
    _tile_loadd(4, a + k, stride);
    _tile_loadd(6, b0 + k * kPanel, 64);  // k pairs k / 2 .. k / 2 + 15
    if constexpr (MT == 2) _tile_loadd(5, a1 + k, stride);
    if constexpr (NT == 2) _tile_loadd(7, b1 + k * kPanel, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MT == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (MT == 2 && NT == 2) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, cbuf, 64);
  if constexpr (NT == 2) _tile_stored(1, cbuf + 256, 64);
  if constexpr (MT == 2) _tile_stored(2, cbuf + 512, 64);
  if constexpr (MT == 2 && NT == 2) _tile_stored(3, cbuf + 768, 64);
}

// amx_block for mt, nt in {1, 2} chosen at run time.
BATCHGEN_AMX_TARGET inline void amx_block_any(int mt, int nt, const uint16_t* a, int64_t lda,
                                              int64_t k_size, const uint16_t* b0, float* cbuf) {
  if (mt == 2 && nt == 2) amx_block<2, 2>(a, lda, k_size, b0, cbuf);
  else if (mt == 2) amx_block<2, 1>(a, lda, k_size, b0, cbuf);
  else if (nt == 2) amx_block<1, 2>(a, lda, k_size, b0, cbuf);
  else amx_block<1, 1>(a, lda, k_size, b0, cbuf);
}

// 1 when this CPU has AMX-BF16 and the OS lets this process use the tile data (Linux asks for
// it once per process: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)), else 0. The
// answer is computed once (the permission is process-wide).
// CPUID leaf 7 is read directly: __builtin_cpu_supports knows "amx-bf16" only from GCC 11
// and recent clang.
inline bool amx_usable() {
  static const bool usable = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    constexpr unsigned kAmxBf16 = 1u << 22, kAmxTile = 1u << 24;  // CPUID.(7, 0):EDX
    if ((edx & kAmxBf16) == 0 || (edx & kAmxTile) == 0) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
}
#else
inline bool amx_usable() { return false; }
#endif

}  // namespace
