// AMX-BF16 micro-kernel of the fused MoE kernel (fused_moe.cpp): tdpbf16ps on 16 x 16 float32
// tiles, blocks of 2 x 2 tiles (32 rows x 32 columns).
//
// Tiles (palette 1): C0..C3 = tmm0..3, 16 rows x 16 float32; A0, A1 = tmm4, 5, 16 rows x 32
// bf16 (row-major activations, stride K); B0, B1 = tmm6, 7, 16 k pairs x 16 columns x 2 bf16:
// exactly 16 rows of a packed weight panel [K / 2][16][2] (the vdpbf16ps layout), stride 64
// bytes. Per 32 k: two A loads, two B loads, four tdpbf16ps. Rows are padded with zero rows to
// a multiple of 16 (their outputs are dropped); K must be a multiple of 32 (`usable`), else
// the driver runs the vdpbf16ps kernel for that GEMM.
//
// Batch invariance: each output row of tdpbf16ps depends on its own A row only, and sums the k
// tiles in order k = 0, 32, 64, ...; so a row's result does not depend on the number of rows.
// Within one tile the hardware's order of the 32 products is fixed (not documented; tested).
// Tile state is per thread: `gemm` loads its configuration and releases it before returning.
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

struct AmxBf16 {
  using In = uint16_t;  // bf16 bits
  static constexpr int kMR = 16;
  static constexpr int64_t kRowChunk = 128;
  static constexpr int64_t kStep = 1;  // row-major: consecutive k pairs are adjacent words
  static constexpr bool kZeroPadRows = true;
  static int64_t row_offset(int64_t row, int64_t k_size) { return row * k_size; }
  static bool usable(int64_t k_size) { return k_size % 32 == 0; }

  // k per cache block: the gate/up GEMM (K = H) runs its k in blocks of kKc so that a panel
  // pair's block (kKc x 32 bf16 = 16 KiB) stays in L1 while the row blocks stream past it;
  // with the whole K = 512 a panel pair (32 KiB) and a 32-row block of A (32 KiB) overflowed
  // the 48 KiB L1, and both came from L2 at every k step.
  static constexpr int64_t kKc = 256;

  // MT x NT tiles of C (rows 16 MT of a, panels b0 and the next) over k in [k0, k1): the tiles
  // start at zero (first) or at cbuf's partial sums, and end in cbuf [4][16][16]. pf: where
  // the next block of B starts in its first panel (null: none), prefetched into L2 at the pace
  // this block reads its own (prefetches never fault, so a shorter next block is harmless).
  template <int MT, int NT>
  BATCHGEN_AMX_TARGET static void block(const uint16_t* a, int64_t k_size, const uint16_t* b0,
                                        int64_t k0, int64_t k1, bool first, float* cbuf,
                                        const uint16_t* pf) {
    const uint16_t* b1 = b0 + k_size * kPanel;
    const uint16_t* a1 = a + 16 * k_size;
    const int64_t stride = k_size * 2;  // bytes per activation row
    if (first) {
      _tile_zero(0);
      if constexpr (NT == 2) _tile_zero(1);
      if constexpr (MT == 2) _tile_zero(2);
      if constexpr (MT == 2 && NT == 2) _tile_zero(3);
    } else {  // exact float32 partial sums: the k order is unchanged
      _tile_loadd(0, cbuf, 64);
      if constexpr (NT == 2) _tile_loadd(1, cbuf + 256, 64);
      if constexpr (MT == 2) _tile_loadd(2, cbuf + 512, 64);
      if constexpr (MT == 2 && NT == 2) _tile_loadd(3, cbuf + 768, 64);
    }
    // Each load is placed right before the first product that reads it: tiles are not
    // renamed, so a load waits for the last product that reads the register's old value.
    for (int64_t k = k0; k < k1; k += 32) {
      _tile_loadd(4, a + k, stride);
      _tile_loadd(6, b0 + k * kPanel, 64);  // k pairs k / 2 .. k / 2 + 15
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (NT == 2) {
        _tile_loadd(7, b1 + k * kPanel, 64);
        _tile_dpbf16ps(1, 4, 7);
      }
      if constexpr (MT == 2) {
        _tile_loadd(5, a1 + k, stride);
        _tile_dpbf16ps(2, 5, 6);
      }
      if constexpr (MT == 2 && NT == 2) _tile_dpbf16ps(3, 5, 7);
      if (pf != nullptr) {  // 1 KiB (16 lines) of each of the next block's two panels
        const char* q0 = reinterpret_cast<const char*>(pf + (k - k0) * kPanel);
        const char* q1 = q0 + k_size * kPanel * 2;
        for (int l = 0; l < 16; ++l) {
          _mm_prefetch(q0 + 64 * l, _MM_HINT_T1);
          _mm_prefetch(q1 + 64 * l, _MM_HINT_T1);
        }
      }
    }
    _tile_stored(0, cbuf, 64);
    if constexpr (NT == 2) _tile_stored(1, cbuf + 256, 64);
    if constexpr (MT == 2) _tile_stored(2, cbuf + 512, 64);
    if constexpr (MT == 2 && NT == 2) _tile_stored(3, cbuf + 768, 64);
  }

  // a: rows [round_up(m, 16)][K] bf16 (rows past m zero), m <= kRowChunk; packed
  // [N / 16][K / 2][16][2]. Loops: panel pairs, k blocks, row blocks of 32; each output is
  // summed over k = 0, 32, 64, ... in order (the partial sums wait in cacc between k blocks).
  BATCHGEN_AMX_TARGET static void gemm(const uint16_t* a, int64_t m, int64_t k_size,
                                       const uint16_t* packed, int64_t n, float* const* c_rows,
                                       const float* scale) {
    AmxTileConfig cfg;
    std::memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
      cfg.rows[t] = 16;
      cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
    alignas(64) float cacc[(kRowChunk + 31) / 32 * 1024];  // [row block][4][16][16]
    const int64_t num_panels = n / kPanel;
    for (int64_t p = 0; p < num_panels; p += 2) {
      const int nt = num_panels - p >= 2 ? 2 : 1;
      const uint16_t* b0 = packed + p * k_size * kPanel;
      for (int64_t k0 = 0; k0 < k_size; k0 += kKc) {
        const int64_t k1 = std::min(k0 + kKc, k_size);
        // The block of B after this one (the next k block, or the next panel pair's first).
        const uint16_t* next = k1 < k_size           ? b0 + k1 * kPanel
                               : p + 2 < num_panels ? b0 + nt * k_size * kPanel
                                                    : nullptr;
        for (int64_t i = 0; i < m; i += 32) {
          const int mt = m - i > 16 ? 2 : 1;
          const uint16_t* ai = a + i * k_size;
          float* cbuf = cacc + (i / 32) * 1024;
          const uint16_t* pf = i == 0 ? next : nullptr;
          if (mt == 2 && nt == 2) block<2, 2>(ai, k_size, b0, k0, k1, k0 == 0, cbuf, pf);
          else if (mt == 2) block<2, 1>(ai, k_size, b0, k0, k1, k0 == 0, cbuf, pf);
          else if (nt == 2) block<1, 2>(ai, k_size, b0, k0, k1, k0 == 0, cbuf, pf);
          else block<1, 1>(ai, k_size, b0, k0, k1, k0 == 0, cbuf, pf);
          if (k1 < k_size) continue;
          for (int tm = 0; tm < mt; ++tm)
            for (int r = 0; r < 16 && i + 16 * tm + r < m; ++r) {
              const int64_t row = i + 16 * tm + r;
              const __m512 s = _mm512_set1_ps(scale != nullptr ? scale[row] : 1.0f);
              for (int tn = 0; tn < nt; ++tn) {
                __m512 v = _mm512_load_ps(cbuf + (2 * tm + tn) * 256 + r * 16);
                if (scale != nullptr) v = _mm512_mul_ps(v, s);
                _mm512_storeu_ps(c_rows[row] + (p + tn) * kPanel, v);
              }
            }
        }
      }
    }
    _tile_release();
  }
};

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
