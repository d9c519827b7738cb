// AVX512-BF16 micro-kernel of the fused MoE kernel (fused_moe.cpp): vdpbf16ps, 12 x 32.
#pragma once

#include "fused_moe_common.h"

namespace {

#if BATCHGEN_HAVE_BF16
// ---- AVX512-BF16: bf16 x bf16 -> float32, 12 rows x 32 columns ---------------------------
// Only gemm carries the target attribute (it is called once per expert chunk); the gather and
// the activation are plain C++ and round with integer arithmetic.
#define BATCHGEN_BF16_TARGET __attribute__((target("avx512f,avx512bf16")))
struct Avx512Bf16 : MicroPanelLayout<12, 2> {
  using In = uint16_t;  // bf16 bits

  // a: one micro-panel [K / 2][MR][2] bf16, read as 32-bit pairs; panel: [K / 2][16][2].
  template <int MR, int NP>
  BATCHGEN_BF16_TARGET static void micro(const uint16_t* a, const uint16_t* panel,
                                         int64_t k_size, float* const* c_rows, int64_t col,
                                         const float* scale) {
    __m512 c[NP][MR];
    for (int q = 0; q < NP; ++q)
      for (int r = 0; r < MR; ++r) c[q][r] = _mm512_setzero_ps();
    const uint16_t* p1 = panel + k_size * kPanel;
    const uint32_t* a32 = reinterpret_cast<const uint32_t*>(a);
    for (int64_t kp = 0; kp < k_size / 2; ++kp) {
      __m512bh b[NP];
      b[0] = (__m512bh)_mm512_loadu_si512(panel + kp * 2 * kPanel);
      if constexpr (NP == 2) b[1] = (__m512bh)_mm512_loadu_si512(p1 + kp * 2 * kPanel);
      for (int r = 0; r < MR; ++r) {
        const __m512bh ar = (__m512bh)_mm512_set1_epi32(static_cast<int>(a32[kp * kMR + r]));
        for (int q = 0; q < NP; ++q) c[q][r] = _mm512_dpbf16_ps(c[q][r], ar, b[q]);
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int q = 0; q < NP; ++q) {
        __m512 v = c[q][r];
        if (scale != nullptr) v = _mm512_mul_ps(v, _mm512_set1_ps(scale[r]));
        _mm512_storeu_ps(c_rows[r] + col + q * kPanel, v);
      }
  }
  template <int NP>
  struct Tail {
    template <int R>
    BATCHGEN_BF16_TARGET static void run(const uint16_t* a, const uint16_t* panel, int64_t k,
                                         float* const* c, int64_t col, const float* s) {
      micro<R, NP>(a, panel, k, c, col, s);
    }
  };
  template <int NP>
  BATCHGEN_BF16_TARGET static void panels(const uint16_t* a, int64_t m, int64_t k_size,
                                          const uint16_t* panel, float* const* c_rows,
                                          int64_t col, const float* scale) {
    int64_t i = 0;
    for (; i + kMR <= m; i += kMR)
      micro<kMR, NP>(a + i * k_size, panel, k_size, c_rows + i, col, scale ? scale + i : nullptr);
    if (i < m)
      dispatch_rows<Tail<NP>, kMR>(m - i, a + i * k_size, panel, k_size, c_rows + i, col,
                                   scale ? scale + i : nullptr);
  }
  BATCHGEN_BF16_TARGET static void gemm(const uint16_t* a, int64_t m, int64_t k_size,
                                        const uint16_t* packed, int64_t n, float* const* c_rows,
                                        const float* scale) {
    const int64_t num_panels = n / kPanel;
    int64_t p = 0;
    for (; p + 2 <= num_panels; p += 2)
      panels<2>(a, m, k_size, packed + p * k_size * kPanel, c_rows, p * kPanel, scale);
    if (p < num_panels)
      panels<1>(a, m, k_size, packed + p * k_size * kPanel, c_rows, p * kPanel, scale);
  }
};
#endif


}  // namespace
