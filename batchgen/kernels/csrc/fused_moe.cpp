// Fused MoE experts on CPU, SiLU-gated (Mixtral, Qwen-MoE, OLMoE, DeepSeek experts):
//   out[t] = sum_a topk_weights[t, a] * W2_e (silu(W1_e x_t) * (W3_e x_t)),  e = topk_ids[t, a]
// in one call: each expert gathers its rows, runs its two GEMMs with a register-blocked
// micro-kernel on weights packed once ahead of time, applies the activation, and writes its
// weighted output rows into a per-(token, slot) float32 buffer; a last pass sums each token's
// slots in slot order (the order of `fused_experts_reference`'s sum over the top-k).
//
// Two entry points:
//   batchgen_fused_moe_silu_f32:  float32 weights and activations. Micro-kernel chosen at
//     compile time (-march=native): AVX-512F (12 rows x 32 columns in 24 zmm accumulators,
//     the shape of BLIS's SkylakeX sgemm) where __AVX512F__ is defined, else AVX2/FMA (6 x 16
//     in 12 ymm, BLIS's Haswell shape). `isa` = 1 forces the AVX2 kernel (A/B measurements).
//   batchgen_fused_moe_silu_bf16: bfloat16 weights and activations, float32 accumulation, with
//     AVX512-BF16's vdpbf16ps (12 x 32 as above, two k per instruction). Compiled with a
//     target attribute, so the library builds on any x86-64 CPU; the caller runs it only when
//     batchgen_fused_moe_bf16_supported() says the CPU has avx512_bf16 (checked at run time).
//
// Why a kernel here: at the row counts of decode steps (a few to tens of rows per expert) a
// loop of MKL GEMMs (torch's F.linear, one thread) on the bench model's 512 x 512 and 256 x 512
// expert weights (64 experts, cold) ran at 13-15 GFLOP/s at 8 rows, 34-37 at 32 and 51 at 64
// (it packs the weight on every call); the AVX2 micro-kernel on pre-packed weights ran at 29,
// 55 and 57; both reach 62-65 at 128 rows. The rest of the gain is the fusion: the per-expert
// torch path spends 25-40% of a layer outside its GEMMs (gathers, SiLU, weighting, index_add,
// about eight small ops per expert).
//
// Layouts:
//   x [T, H]; float32: w13p [E, 2I / 16, H, 16] and w2p [E, H / 16, I, 16]: the [N, K] weights
//   (vLLM's FusedMoE w13 [E, 2I, H], w2 [E, H, I]) cut into panels of 16 output columns, each
//   panel stored k-major ([K][16]) so the micro-kernel reads it sequentially. bfloat16: panels
//   [K / 2][16][2]: pairs of k interleaved per column, the operand layout of vdpbf16ps.
//   topk_weights [T * A] float32; order [T * A]: the flat (t, a) slot of each sorted row,
//   grouped by expert; starts [E + 1]: expert e's rows are order[starts[e] : starts[e + 1]];
//   y_slots [T * A, H] float32 scratch; out [T, H] float32.
//
// Every micro-kernel sums each output over k in one fixed sequential order whatever the number
// of rows (one accumulator per output, k = 0, 1, ...; in bf16 each vdpbf16ps adds the pair
// (k, k + 1) to it), so a token's result does not depend on which other tokens share its expert
// call (batch-invariant). The AVX2 and AVX-512 float32 kernels run the same FMA chain per
// output: their results are bit-identical.
//
// bf16 numerics: gate/up are float32 sums of exact bf16 x bf16 products; silu(gate) * up is
// computed in float32 and rounded once to bf16 (round to nearest even) as the down GEMM's
// input; the down GEMM, the router weighting and the slot sum are float32. The torch path
// rounds gate, up, silu(gate), their product and the down output to bf16 instead.
// vdpbf16ps treats bf16 subnormal inputs as zero and flushes subnormal results.
//
// Experts are spread over OpenMP threads (dynamic: experts differ in rows); the library joins
// torch's OpenMP runtime like paged_decode_attention.cpp.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

// The bf16 kernel needs a compiler that knows AVX512-BF16 (GCC 10, clang 9) and x86-64.
#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 9) || \
                            (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10))
#define BATCHGEN_HAVE_BF16 1
#else
#define BATCHGEN_HAVE_BF16 0
#endif

namespace {

constexpr int64_t kPanel = 16;      // output columns per packed panel
constexpr int64_t kRowChunk = 120;  // rows per gather chunk: 120 x 512 floats = 240 KiB (L2)

// Activations go into micro-panels, not row-major rows: block b holds rows MR*b..MR*b+MR-1
// stored k-major ([K][MR]; bf16: [K / 2][MR][2]), so the micro-kernel's broadcasts read one
// sequential stream instead of MR rows K apart (BLIS packs A the same way). The gather and the
// SiLU write this layout directly. Measured for the AVX2 kernel with
// `benchmarks/moe_layer.py --rounds 3` against row-major rows (E 64, top-8, H 512, I 256, 2
// threads): 64 tokens 9.9-10.6 ms vs 11.7-12.6, 512 tokens 32.5-36.3 vs 45.2-46.5.

// Tail dispatch: calls F::template run<R>(args...) for R = rem (1 <= rem < MR).
template <class F, int MR, int R = 1, class... Args>
inline void dispatch_rows(int64_t rem, Args... args) {
  if constexpr (R < MR) {
    if (rem == R) {
      F::template run<R>(args...);
      return;
    }
    dispatch_rows<F, MR, R + 1>(rem, args...);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// ---- AVX2 / FMA, float32: 6 rows x 16 columns -------------------------------------------
struct Avx2F32 {
  using In = float;
  static constexpr int kMR = 6;

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
                   float* const* c_rows, const float* scale) {
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
struct Avx512F32 {
  using In = float;
  static constexpr int kMR = 12;

  template <int MR, int NP>
  static void micro(const float* a, const float* panel, int64_t k_size, float* const* c_rows,
                    int64_t col, const float* scale) {
    __m512 c[NP][MR];
    for (int q = 0; q < NP; ++q)
      for (int r = 0; r < MR; ++r) c[q][r] = _mm512_setzero_ps();
    const float* p1 = panel + k_size * kPanel;  // the next panel (NP = 2)
    for (int64_t k = 0; k < k_size; ++k) {
      __m512 b[NP];
      b[0] = _mm512_loadu_ps(panel + k * kPanel);
      if constexpr (NP == 2) b[1] = _mm512_loadu_ps(p1 + k * kPanel);
      for (int r = 0; r < MR; ++r) {
        const __m512 ar = _mm512_set1_ps(a[k * kMR + r]);
        for (int q = 0; q < NP; ++q) c[q][r] = _mm512_fmadd_ps(ar, b[q], c[q][r]);
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
    static void run(const float* a, const float* panel, int64_t k, float* const* c, int64_t col,
                    const float* s) {
      micro<R, NP>(a, panel, k, c, col, s);
    }
  };
  template <int NP>
  static void panels(const float* a, int64_t m, int64_t k_size, const float* panel,
                     float* const* c_rows, int64_t col, const float* scale) {
    int64_t i = 0;
    for (; i + kMR <= m; i += kMR)
      micro<kMR, NP>(a + i * k_size, panel, k_size, c_rows + i, col, scale ? scale + i : nullptr);
    if (i < m)
      dispatch_rows<Tail<NP>, kMR>(m - i, a + i * k_size, panel, k_size, c_rows + i, col,
                                   scale ? scale + i : nullptr);
  }
  static void gemm(const float* a, int64_t m, int64_t k_size, const float* packed, int64_t n,
                   float* const* c_rows, const float* scale) {
    const int64_t num_panels = n / kPanel;
    int64_t p = 0;
    for (; p + 2 <= num_panels; p += 2)
      panels<2>(a, m, k_size, packed + p * k_size * kPanel, c_rows, p * kPanel, scale);
    if (p < num_panels)
      panels<1>(a, m, k_size, packed + p * k_size * kPanel, c_rows, p * kPanel, scale);
  }
};
#endif

#if BATCHGEN_HAVE_BF16
// ---- AVX512-BF16: bf16 x bf16 -> float32, 12 rows x 32 columns ---------------------------
// Only gemm carries the target attribute (it is called once per expert chunk); the gather and
// the activation are plain C++ and round with integer arithmetic.
#define BATCHGEN_BF16_TARGET __attribute__((target("avx512f,avx512bf16")))
struct Avx512Bf16 {
  using In = uint16_t;  // bf16 bits
  static constexpr int kMR = 12;

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

// float32 -> bf16 bits, round to nearest even (finite inputs; the kernels see no NaN).
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Element k of row `row` in a packed activation block (see the layouts above).
template <class In, int MR>
inline int64_t panel_index(int64_t row, int64_t k, int64_t k_size) {
  const int64_t base = (row / MR) * k_size * MR;
  if constexpr (sizeof(In) == 4) return base + k * MR + row % MR;
  return base + (k / 2) * MR * 2 + (row % MR) * 2 + (k % 2);
}

// The layer, for one micro-kernel K (Avx2F32, Avx512F32 or Avx512Bf16).
template <class K>
int run_experts(const typename K::In* x, const typename K::In* w13p, const typename K::In* w2p,
                const float* topk_weights, const int64_t* order, const int64_t* starts,
                float* y_slots, float* out, int64_t num_tokens, int64_t hidden, int64_t inter,
                int64_t top_k, int64_t num_experts, int64_t num_threads) {
  using In = typename K::In;
  constexpr int MR = K::kMR;
  if (hidden % kPanel != 0 || (2 * inter) % kPanel != 0 || top_k <= 0) return 1;
  const int64_t h = hidden, i2 = 2 * inter;
  num_threads = std::max<int64_t>(1, num_threads);
#pragma omp parallel num_threads(num_threads)
  {
    // Per-thread scratch kept across calls (OpenMP reuses its threads): no fresh pages per call.
    // a_buf and act hold micro-panels: kRowChunk rows rounded up to whole panels.
    constexpr int64_t kPanelRows = (kRowChunk + MR - 1) / MR * MR;
    thread_local std::vector<In> a_buf, act;
    thread_local std::vector<float> g_buf, act_f32;
    thread_local std::vector<float> scale(kRowChunk);
    thread_local std::vector<float*> g_rows(kRowChunk), y_rows(kRowChunk);
    if (a_buf.size() < static_cast<size_t>(kPanelRows * h)) a_buf.resize(kPanelRows * h);
    if (g_buf.size() < static_cast<size_t>(kRowChunk * i2)) g_buf.resize(kRowChunk * i2);
    if (act.size() < static_cast<size_t>(kPanelRows * inter)) act.resize(kPanelRows * inter);
    if (act_f32.size() < static_cast<size_t>(inter)) act_f32.resize(inter);
    for (int64_t r = 0; r < kRowChunk; ++r) g_rows[r] = g_buf.data() + r * i2;
#pragma omp for schedule(dynamic, 1)
    for (int64_t e = 0; e < num_experts; ++e) {
      const In* w13 = w13p + e * i2 * h;
      const In* w2 = w2p + e * h * inter;
      // Rows in chunks of at most kRowChunk, of about equal size (no short last chunk that
      // would stream the weights again for a few rows).
      const int64_t rows = starts[e + 1] - starts[e];
      const int64_t chunks = (rows + kRowChunk - 1) / kRowChunk;
      const int64_t chunk = chunks ? (rows + chunks - 1) / chunks : 0;
      for (int64_t r0 = starts[e]; r0 < starts[e + 1]; r0 += chunk) {
        const int64_t m = std::min(chunk, starts[e + 1] - r0);
        for (int64_t r = 0; r < m; ++r) {
          const int64_t slot = order[r0 + r];
          const In* src = x + (slot / top_k) * h;
          In* dst = a_buf.data() + panel_index<In, MR>(r, 0, h);
          if constexpr (sizeof(In) == 4) {
            for (int64_t k = 0; k < h; ++k) dst[k * MR] = src[k];
          } else {  // bf16 pairs as 32-bit words
            uint32_t* d32 = reinterpret_cast<uint32_t*>(dst);
            const uint32_t* s32 = reinterpret_cast<const uint32_t*>(src);
            for (int64_t k = 0; k < h / 2; ++k) d32[k * MR] = s32[k];
          }
          y_rows[r] = y_slots + slot * h;
          scale[r] = topk_weights[slot];
        }
        K::gemm(a_buf.data(), m, h, w13, i2, g_rows.data(), nullptr);  // [m, 2I]: gate, up
        for (int64_t r = 0; r < m; ++r) {
          const float* g = g_buf.data() + r * i2;
          In* o = act.data() + panel_index<In, MR>(r, 0, inter);
          // exp's argument capped below float overflow (exp(88) = 1.65e38): under fast math
          // 1 / (1 + inf) is computed as rcp(inf) plus a Newton step, which gives NaN, not 0.
          if constexpr (sizeof(In) == 4) {
#pragma omp simd
            for (int64_t j = 0; j < inter; ++j) {
              const float ex = std::exp(std::min(-g[j], 88.0f));
              o[j * MR] = g[j] / (1.0f + ex) * g[inter + j];
            }
          } else {  // float32 first (a vector loop), then rounded into bf16 pairs
            float* f = act_f32.data();
#pragma omp simd
            for (int64_t j = 0; j < inter; ++j) {
              const float ex = std::exp(std::min(-g[j], 88.0f));
              f[j] = g[j] / (1.0f + ex) * g[inter + j];
            }
            uint32_t* o32 = reinterpret_cast<uint32_t*>(o);
            for (int64_t j = 0; j < inter / 2; ++j)
              o32[j * MR] = to_bf16(f[2 * j]) | (uint32_t{to_bf16(f[2 * j + 1])} << 16);
          }
        }
        K::gemm(act.data(), m, inter, w2, h, y_rows.data(), scale.data());  // weighted [m, H]
      }
    }
    // Each token's slots, summed in slot order.
#pragma omp for schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t) {
      float* o = out + t * h;
      const float* y = y_slots + t * top_k * h;
      std::copy(y, y + h, o);
      for (int64_t a = 1; a < top_k; ++a) {
#pragma omp simd
        for (int64_t j = 0; j < h; ++j) o[j] += y[a * h + j];
      }
    }
  }
  return 0;
}

}  // namespace

// isa: 0 = the best float32 kernel this build has, 1 = the AVX2 one (for A/B measurements).
// Returns 0, or 1 (shapes not multiples of 16 / top_k <= 0), 2 (no such kernel in this build).
extern "C" int batchgen_fused_moe_silu_f32(const float* x, const float* w13p, const float* w2p,
                                           const float* topk_weights, const int64_t* order,
                                           const int64_t* starts, float* y_slots, float* out,
                                           int64_t num_tokens, int64_t hidden, int64_t inter,
                                           int64_t top_k, int64_t num_experts,
                                           int64_t num_threads, int64_t isa) {
#if defined(__AVX512F__)
  if (isa == 0)
    return run_experts<Avx512F32>(x, w13p, w2p, topk_weights, order, starts, y_slots, out,
                                  num_tokens, hidden, inter, top_k, num_experts, num_threads);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (isa == 0 || isa == 1)
    return run_experts<Avx2F32>(x, w13p, w2p, topk_weights, order, starts, y_slots, out,
                                num_tokens, hidden, inter, top_k, num_experts, num_threads);
#endif
  (void)x, (void)w13p, (void)w2p, (void)topk_weights, (void)order, (void)starts;
  (void)y_slots, (void)out, (void)num_tokens, (void)hidden, (void)inter, (void)top_k;
  (void)num_experts, (void)num_threads, (void)isa;
  return 2;
}

extern "C" int batchgen_fused_moe_bf16_supported();

// x, w13p, w2p: bf16 bits (uint16); everything else as for float32.
extern "C" int batchgen_fused_moe_silu_bf16(const uint16_t* x, const uint16_t* w13p,
                                            const uint16_t* w2p, const float* topk_weights,
                                            const int64_t* order, const int64_t* starts,
                                            float* y_slots, float* out, int64_t num_tokens,
                                            int64_t hidden, int64_t inter, int64_t top_k,
                                            int64_t num_experts, int64_t num_threads) {
#if BATCHGEN_HAVE_BF16
  if (!batchgen_fused_moe_bf16_supported()) return 2;
  return run_experts<Avx512Bf16>(x, w13p, w2p, topk_weights, order, starts, y_slots, out,
                                 num_tokens, hidden, inter, top_k, num_experts, num_threads);
#else
  (void)x, (void)w13p, (void)w2p, (void)topk_weights, (void)order, (void)starts;
  (void)y_slots, (void)out, (void)num_tokens, (void)hidden, (void)inter, (void)top_k;
  (void)num_experts, (void)num_threads;
  return 2;
#endif
}

// Which float32 micro-kernel `isa` = 0 runs: 2 = AVX-512F, 1 = AVX2/FMA, 0 = none (the caller
// uses the torch path).
extern "C" int batchgen_fused_moe_supported() {
#if defined(__AVX512F__)
  return 2;
#elif defined(__AVX2__) && defined(__FMA__)
  return 1;
#else
  return 0;
#endif
}

// 1 when the bf16 kernel is built and this CPU has AVX512-BF16 (and AVX-512F), else 0.
extern "C" int batchgen_fused_moe_bf16_supported() {
#if BATCHGEN_HAVE_BF16
  __builtin_cpu_init();  // idempotent; safe however early the library is loaded
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16") ? 1 : 0;
#else
  return 0;
#endif
}
