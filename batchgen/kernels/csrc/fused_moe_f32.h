// float32 micro-kernels of the fused MoE kernel (fused_moe.cpp): AVX2/FMA 6 x 16 and
// AVX-512F 12 x 32, both summing each output over k in one FMA chain (bit-identical results).
#pragma once

#include "fused_moe_common.h"

namespace {

#if defined(__AVX2__) && defined(__FMA__)
// ---- AVX2 / FMA, float32: 6 rows x 16 columns -------------------------------------------
struct Avx2F32 : MicroPanelLayout<6, 1> {
  using In = float;
  static WeightPrefetch moe_prefetch() { return WeightPrefetch::kNone; }

  // c_rows[r][col : col + 16] = scale[r] * (A[r, :K] . panel) for r < MR; A is one packed
  // micro-panel ([K][6], rows past MR unused).
  template <int MR>
  static void micro(const float* a, const float* panel, int64_t k_size, float* const* c_rows,
                    int64_t col, const float* scale) {
    __m256 c0[MR], c1[MR];
    for (int r = 0; r < MR; ++r) c0[r] = c1[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < k_size; ++k) {
      const __m256 b0 = _mm256_loadu_ps(panel + k * kPanel);
      const __m256 b1 = _mm256_loadu_ps(panel + k * kPanel + 8);
      for (int r = 0; r < MR; ++r) {
        const __m256 ar = _mm256_broadcast_ss(a + k * kMR + r);
        c0[r] = _mm256_fmadd_ps(ar, b0, c0[r]);
        c1[r] = _mm256_fmadd_ps(ar, b1, c1[r]);
      }
    }
    for (int r = 0; r < MR; ++r) {
      if (scale != nullptr) {
        const __m256 s = _mm256_broadcast_ss(scale + r);
        c0[r] = _mm256_mul_ps(c0[r], s);
        c1[r] = _mm256_mul_ps(c1[r], s);
      }
      _mm256_storeu_ps(c_rows[r] + col, c0[r]);
      _mm256_storeu_ps(c_rows[r] + col + 8, c1[r]);
    }
  }
  struct Tail {
    template <int R>
    static void run(const float* a, const float* panel, int64_t k, float* const* c, int64_t col,
                    const float* s) {
      micro<R>(a, panel, k, c, col, s);
    }
  };

  // C = A [m, K] @ W^T, A in micro-panels, W packed [N / 16][K][16]; row r of C at c_rows[r],
  // scaled by scale[r] when scale is not null.
  static void gemm(const float* a, int64_t m, int64_t k_size, const float* packed, int64_t n,
                   float* const* c_rows, const float* scale, bool /*stream: bf16 kernels only*/,
                   WeightPrefetch /*none here*/ = WeightPrefetch::kNone) {
    for (int64_t p = 0; p < n / kPanel; ++p) {
      const float* panel = packed + p * k_size * kPanel;
      const int64_t col = p * kPanel;
      int64_t i = 0;
      for (; i + kMR <= m; i += kMR)
        micro<kMR>(a + i * k_size, panel, k_size, c_rows + i, col, scale ? scale + i : nullptr);
      if (i < m)
        dispatch_rows<Tail, kMR>(m - i, a + i * k_size, panel, k_size, c_rows + i, col,
                                 scale ? scale + i : nullptr);
    }
  }
};
#endif

#if defined(__AVX512F__)
// ---- AVX-512F, float32: 12 rows x 32 columns (two 16-column panels) ---------------------
// Per k: two weight loads, 12 broadcasts, 24 FMAs into 24 zmm accumulators (of 32). An odd
// last panel runs 12 x 16.
struct Avx512F32 : MicroPanelLayout<12, 1> {
  using In = float;

  // Software prefetch along each weight panel for the first row block of a panel pair
  // (WeightPrefetch, fused_moe_common.h). On the Intel AMX machine (bench layer, one thread,
  // loaded machine) at 70 tokens, T0 at 1, 2 and 4 KiB ahead ran 0.89, 0.85 and 0.85 of the
  // time without prefetch: kL1Near there; kL2Far on AMD.
  static WeightPrefetch moe_prefetch() { return cpu_weight_prefetch(WeightPrefetch::kL1Near); }

  // c_rows[r][col : col + 16 NP] = scale[r] * (A[r, :K] . panels) for r < MR. With `stream`
  // (a scaled down GEMM into y_slots rows of a large call) the rows are written with
  // non-temporal stores where 64-byte aligned (AmxBf16::StoreRows says why); gemm fences them.
  template <int MR, int NP, WeightPrefetch kPrefetch>
  static void micro(const float* a, const float* panel, int64_t k_size, float* const* c_rows,
                    int64_t col, const float* scale, bool stream) {
    __m512 c[NP][MR];
    for (int q = 0; q < NP; ++q)
      for (int r = 0; r < MR; ++r) c[q][r] = _mm512_setzero_ps();
    const float* p1 = panel + k_size * kPanel;  // the next panel (NP = 2)
    for (int64_t k = 0; k < k_size; ++k) {
      prefetch_weights<kPrefetch>(panel + k * kPanel);
      if constexpr (NP == 2) prefetch_weights<kPrefetch>(p1 + k * kPanel);
      __m512 b[NP];
      b[0] = _mm512_loadu_ps(panel + k * kPanel);
      if constexpr (NP == 2) b[1] = _mm512_loadu_ps(p1 + k * kPanel);
      for (int r = 0; r < MR; ++r) {
        const __m512 ar = _mm512_set1_ps(a[k * kMR + r]);
        for (int q = 0; q < NP; ++q) c[q][r] = _mm512_fmadd_ps(ar, b[q], c[q][r]);
      }
    }
    for (int r = 0; r < MR; ++r) {
      float* c_row = c_rows[r] + col;
      const bool aligned = stream && (reinterpret_cast<uintptr_t>(c_row) & 63) == 0;
      for (int q = 0; q < NP; ++q) {
        __m512 v = c[q][r];
        if (scale != nullptr) v = _mm512_mul_ps(v, _mm512_set1_ps(scale[r]));
        if (aligned) _mm512_stream_ps(c_row + q * kPanel, v);
        else _mm512_storeu_ps(c_row + q * kPanel, v);
      }
    }
  }
  template <int NP, WeightPrefetch kPrefetch>
  struct Tail {
    template <int R>
    static void run(const float* a, const float* panel, int64_t k, float* const* c, int64_t col,
                    const float* s, bool stream) {
      micro<R, NP, kPrefetch>(a, panel, k, c, col, s, stream);
    }
  };
  template <int NP, WeightPrefetch P>
  static void panels(const float* a, int64_t m, int64_t k_size, const float* panel,
                     float* const* c_rows, int64_t col, const float* scale, bool stream) {
    constexpr WeightPrefetch kNone = WeightPrefetch::kNone;
    int64_t i = 0;
    if (m >= kMR) {  // the first row block prefetches the panels' next lines
      micro<kMR, NP, P>(a, panel, k_size, c_rows, col, scale, stream);
      i = kMR;
    }
    for (; i + kMR <= m; i += kMR)
      micro<kMR, NP, kNone>(a + i * k_size, panel, k_size, c_rows + i, col,
                            scale ? scale + i : nullptr, stream);
    if (i < m) {
      if (i == 0)
        dispatch_rows<Tail<NP, P>, kMR>(m, a, panel, k_size, c_rows, col, scale, stream);
      else
        dispatch_rows<Tail<NP, kNone>, kMR>(m - i, a + i * k_size, panel, k_size, c_rows + i,
                                            col, scale ? scale + i : nullptr, stream);
    }
  }
  // stream: non-temporal stores of scaled rows (the driver's choice for a large call);
  // pf: the weight prefetch (the driver passes moe_prefetch()).
  static void gemm(const float* a, int64_t m, int64_t k_size, const float* packed, int64_t n,
                   float* const* c_rows, const float* scale, bool stream,
                   WeightPrefetch pf = WeightPrefetch::kL1Near) {
    switch (pf) {
      case WeightPrefetch::kNone:
        return gemm_with<WeightPrefetch::kNone>(a, m, k_size, packed, n, c_rows, scale, stream);
      case WeightPrefetch::kL1Near:
        return gemm_with<WeightPrefetch::kL1Near>(a, m, k_size, packed, n, c_rows, scale, stream);
      case WeightPrefetch::kL2Far:
        return gemm_with<WeightPrefetch::kL2Far>(a, m, k_size, packed, n, c_rows, scale, stream);
    }
  }
  template <WeightPrefetch P>
  static void gemm_with(const float* a, int64_t m, int64_t k_size, const float* packed,
                        int64_t n, float* const* c_rows, const float* scale, bool stream) {
    stream = stream && scale != nullptr;
    const int64_t num_panels = n / kPanel;
    int64_t p = 0;
    for (; p + 2 <= num_panels; p += 2)
      panels<2, P>(a, m, k_size, packed + p * k_size * kPanel, c_rows, p * kPanel, scale,
                   stream);
    if (p < num_panels)
      panels<1, P>(a, m, k_size, packed + p * k_size * kPanel, c_rows, p * kPanel, scale,
                   stream);
    if (stream) _mm_sfence();
  }
};
#endif


}  // namespace
