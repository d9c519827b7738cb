// AVX512-BF16 micro-kernel of the fused MoE kernel (fused_moe.cpp): vdpbf16ps, 12 x 32.
#pragma once

#include "fused_moe_common.h"

namespace {

#if BATCHGEN_HAVE_BF16
// glibc's libmvec expf, 16 lanes (AVX-512; the x86-64 vector function ABI's name; glibc
// 2.22+). GCC's vectoriser picks the 8-lane AVX2 one (_ZGVdN8v_expf) on CPUs where it prefers
// 256-bit vectors, as on this project's machines. Both variants are within 4 ULP of the
// correctly rounded result (glibc's manual, "Errors in Math Functions": the vector variants
// of expf on x86_64), far below the bf16 rounding that follows.
extern "C" __attribute__((target("avx512f"))) __m512 _ZGVeN16v_expf(__m512);

// The SiLU-gated activation of one row, rounded to bf16: for j < n (n even),
//   act_j = silu(gate_j) * up_j = gate_j / (1 + exp(-gate_j)) * up_j
// in float32, rounded to nearest even like `to_bf16`, written as pairs: word j / 2 (elements
// j, j + 1) at out32[(j / 2) * step]. exp's argument is capped at 88 (exp(88) = 1.65e38, as
// in the float32 path): a gate below -88 gives a tiny silu instead of an inf denominator.
// Elementwise with one code path for every lane (a short last vector is masked, not a scalar
// tail), so an element's result does not depend on n or on its position.
#define BATCHGEN_BF16_ACT_TARGET __attribute__((target("avx512f,avx512bw,avx512vl")))
BATCHGEN_BF16_ACT_TARGET inline void silu_mul_to_bf16_pairs(const float* gate, const float* up,
                                                            int64_t n, uint32_t* out32,
                                                            int64_t step) {
  const __m512 cap = _mm512_set1_ps(88.0f), one = _mm512_set1_ps(1.0f);
  const __m512i half = _mm512_set1_epi32(0x7fff), lsb = _mm512_set1_epi32(1);
  for (int64_t j = 0; j < n; j += 16) {
    const int64_t len = std::min<int64_t>(16, n - j);
    const __mmask16 mask = static_cast<__mmask16>((1u << len) - 1);
    const __m512 g = _mm512_maskz_loadu_ps(mask, gate + j);
    const __m512 u = _mm512_maskz_loadu_ps(mask, up + j);
    const __m512 ex = _ZGVeN16v_expf(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), cap));
    const __m512 f = _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, ex)), u);
    __m512i b = _mm512_castps_si512(f);  // bits + 0x7fff + lowest kept bit, then >> 16
    const __m512i lowest_kept = _mm512_and_si512(_mm512_srli_epi32(b, 16), lsb);
    b = _mm512_add_epi32(b, _mm512_add_epi32(half, lowest_kept));
    const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(b, 16));  // 16 x bf16 = 8 words
    if (step == 1) {
      _mm256_mask_storeu_epi32(out32 + j / 2, static_cast<__mmask8>((1u << (len / 2)) - 1), h);
    } else {
      alignas(32) uint32_t w[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(w), h);
      for (int64_t q = 0; q < len / 2; ++q) out32[(j / 2 + q) * step] = w[q];
    }
  }
}

// ---- AVX512-BF16: bf16 x bf16 -> float32, 12 rows x 32 columns ---------------------------
// Only gemm carries the target attribute (it is called once per expert chunk); the gather and
// the activation are plain C++ and round with integer arithmetic.
#define BATCHGEN_BF16_TARGET __attribute__((target("avx512f,avx512bf16")))
struct Avx512Bf16 : MicroPanelLayout<12, 2> {
  using In = uint16_t;  // bf16 bits
  // The fused MoE's weight prefetch (WeightPrefetch): kL2Far on AMD, none elsewhere (no
  // measurement on Intel, where the AMX kernel runs); the dense packed_linear.cpp passes none.
  static WeightPrefetch moe_prefetch() { return cpu_weight_prefetch(WeightPrefetch::kNone); }

  // a: one micro-panel [K / 2][MR][2] bf16, read as 32-bit pairs; panel: [K / 2][16][2].
  template <int MR, int NP, WeightPrefetch kPrefetch>
  BATCHGEN_BF16_TARGET static void micro(const uint16_t* a, const uint16_t* panel,
                                         int64_t k_size, float* const* c_rows, int64_t col,
                                         const float* scale, bool stream) {
    __m512 c[NP][MR];
    for (int q = 0; q < NP; ++q)
      for (int r = 0; r < MR; ++r) c[q][r] = _mm512_setzero_ps();
    const uint16_t* p1 = panel + k_size * kPanel;
    const uint32_t* a32 = reinterpret_cast<const uint32_t*>(a);
    for (int64_t kp = 0; kp < k_size / 2; ++kp) {
      prefetch_weights<kPrefetch>(panel + kp * 2 * kPanel);
      if constexpr (NP == 2) prefetch_weights<kPrefetch>(p1 + kp * 2 * kPanel);
      __m512bh b[NP];
      b[0] = (__m512bh)_mm512_loadu_si512(panel + kp * 2 * kPanel);
      if constexpr (NP == 2) b[1] = (__m512bh)_mm512_loadu_si512(p1 + kp * 2 * kPanel);
      for (int r = 0; r < MR; ++r) {
        const __m512bh ar = (__m512bh)_mm512_set1_epi32(static_cast<int>(a32[kp * kMR + r]));
        for (int q = 0; q < NP; ++q) c[q][r] = _mm512_dpbf16_ps(c[q][r], ar, b[q]);
      }
    }
    // With a scale and `stream` (the down GEMM into y_slots rows of a large call):
    // non-temporal stores where aligned, as in the AMX kernel (AmxBf16::StoreRows says why);
    // gemm fences them.
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
    BATCHGEN_BF16_TARGET static void run(const uint16_t* a, const uint16_t* panel, int64_t k,
                                         float* const* c, int64_t col, const float* s,
                                         bool stream) {
      micro<R, NP, kPrefetch>(a, panel, k, c, col, s, stream);
    }
  };
  // The first row block prefetches the panels' next lines as P says (Avx512F32::panels).
  template <int NP, WeightPrefetch P>
  BATCHGEN_BF16_TARGET static void panels(const uint16_t* a, int64_t m, int64_t k_size,
                                          const uint16_t* panel, float* const* c_rows,
                                          int64_t col, const float* scale, bool stream) {
    constexpr WeightPrefetch kNone = WeightPrefetch::kNone;
    int64_t i = 0;
    if (m >= kMR) {
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
  // stream: non-temporal stores of scaled rows (the fused MoE's y_slots of a large call);
  // pf: the weight prefetch (the fused MoE passes moe_prefetch()). The dense
  // packed_linear.cpp passes no scale and keeps the defaults.
  BATCHGEN_BF16_TARGET static void gemm(const uint16_t* a, int64_t m, int64_t k_size,
                                        const uint16_t* packed, int64_t n, float* const* c_rows,
                                        const float* scale, bool stream = false,
                                        WeightPrefetch pf = WeightPrefetch::kNone) {
    if (pf == WeightPrefetch::kL2Far)
      gemm_with<WeightPrefetch::kL2Far>(a, m, k_size, packed, n, c_rows, scale, stream);
    else if (pf == WeightPrefetch::kL1Near)
      gemm_with<WeightPrefetch::kL1Near>(a, m, k_size, packed, n, c_rows, scale, stream);
    else
      gemm_with<WeightPrefetch::kNone>(a, m, k_size, packed, n, c_rows, scale, stream);
  }
  template <WeightPrefetch P>
  BATCHGEN_BF16_TARGET static void gemm_with(const uint16_t* a, int64_t m, int64_t k_size,
                                             const uint16_t* packed, int64_t n,
                                             float* const* c_rows, const float* scale,
                                             bool stream) {
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
