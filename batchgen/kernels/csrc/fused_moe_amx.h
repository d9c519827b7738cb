// AMX-BF16 micro-kernel of the fused MoE kernel (fused_moe.cpp): tdpbf16ps on 16 x 16 float32
// tiles, blocks of 2 x 2 tiles (32 rows x 32 columns; the tiles, the tile configuration and the
// OS permission are in amx_bf16.h, shared with packed_linear.cpp).
//
// Activations are row-major (stride K). Rows are padded with zero rows to a multiple of 16
// (their outputs are dropped); K must be a multiple of 32 (`usable`), else the driver runs the
// vdpbf16ps kernel for that GEMM. Batch invariance: see amx_bf16.h.
#pragma once

#include "amx_bf16.h"
#include "fused_moe_common.h"

namespace {

#if BATCHGEN_HAVE_AMX
struct AmxBf16 {
  using In = uint16_t;  // bf16 bits
  static constexpr int kMR = 16;
  static constexpr int64_t kRowChunk = 128;
  static constexpr int64_t kStep = 1;  // row-major: consecutive k pairs are adjacent words
  static constexpr bool kZeroPadRows = true;
  static int64_t row_offset(int64_t row, int64_t k_size) { return row * k_size; }
  static bool usable(int64_t k_size) { return k_size % 32 == 0; }

  // a: rows [round_up(m, 16)][K] bf16 (rows past m zero); packed [N / 16][K / 2][16][2].
  BATCHGEN_AMX_TARGET static void gemm(const uint16_t* a, int64_t m, int64_t k_size,
                                       const uint16_t* packed, int64_t n, float* const* c_rows,
                                       const float* scale) {
    amx_tile_config();
    alignas(64) float cbuf[4 * 256];
    const int64_t num_panels = n / kPanel;
    for (int64_t p = 0; p < num_panels; p += 2) {
      const int nt = num_panels - p >= 2 ? 2 : 1;
      const uint16_t* b0 = packed + p * k_size * kPanel;
      for (int64_t i = 0; i < m; i += 32) {
        const int mt = m - i > 16 ? 2 : 1;
        const uint16_t* ai = a + i * k_size;
        amx_block_any(mt, nt, ai, k_size, k_size, b0, cbuf);
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
    _tile_release();
  }
};

#endif

}  // namespace
