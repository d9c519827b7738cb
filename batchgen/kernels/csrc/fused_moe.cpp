// Fused MoE experts on CPU, float32, SiLU-gated (Mixtral, Qwen-MoE, OLMoE, DeepSeek experts):
//   out[t] = sum_a topk_weights[t, a] * W2_e (silu(W1_e x_t) * (W3_e x_t)),  e = topk_ids[t, a]
// in one call: each expert gathers its rows, runs its two GEMMs with a register-blocked AVX2
// micro-kernel on weights packed once ahead of time, applies the activation, and writes its
// weighted output rows into a per-(token, slot) buffer; a last pass sums each token's slots in
// slot order (the order of `fused_experts_reference`'s sum over the top-k).
//
// Why a kernel here: at the row counts of decode steps (a few to tens of rows per expert) a
// loop of MKL GEMMs (torch's F.linear, one thread) on the bench model's 512 x 512 and 256 x 512
// expert weights (64 experts, cold) ran at 13-15 GFLOP/s at 8 rows, 34-37 at 32 and 51 at 64
// (it packs the weight on every call); this micro-kernel on pre-packed weights ran at 29, 55
// and 57; both reach 62-65 at 128 rows. The rest of the gain is the fusion: the per-expert
// torch path spends 25-40% of a layer outside its GEMMs (gathers, SiLU, weighting, index_add,
// about eight small ops per expert).
//
// Layouts:
//   x [T, H]; w13p [E, 2I / 16, H, 16] and w2p [E, H / 16, I, 16]: the [N, K] weights
//   (vLLM's FusedMoE w13 [E, 2I, H], w2 [E, H, I]) cut into panels of 16 output columns, each
//   panel stored k-major ([K][16]) so the micro-kernel reads it sequentially;
//   topk_weights [T * A]; order [T * A]: the flat (t, a) slot of each sorted row, grouped by
//   expert; starts [E + 1]: expert e's rows are order[starts[e] : starts[e + 1]];
//   y_slots [T * A, H] scratch; out [T, H].
//
// The micro-kernel (6 rows x 16 columns in 12 __m256 accumulators, BLIS's Haswell shape) sums
// each output over k in a fixed order whatever the number of rows, so a token's result does not
// depend on which other tokens share its expert call (batch-invariant).
//
// Experts are spread over OpenMP threads (dynamic: experts differ in rows); the library joins
// torch's OpenMP runtime like paged_decode_attention.cpp.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

constexpr int64_t kPanel = 16;      // output columns per packed panel
constexpr int64_t kRowChunk = 120;  // rows per gather chunk: 120 x 512 floats = 240 KiB (L2)

constexpr int kMR = 6;              // rows per micro-kernel call (BLIS's Haswell 6 x 16)

// Activations go into micro-panels, not row-major rows: block b holds rows 6b..6b+5 stored
// k-major ([K][6]), so the micro-kernel's broadcasts read one sequential stream instead of six
// rows K floats apart (BLIS packs A the same way). The gather and the SiLU write this layout
// directly. `benchmarks/moe_layer.py --rounds 3`, two alternations against row-major rows on
// the bench layer (E 64, top-8, H 512, I 256, 2 threads): 64 tokens 9.9-10.6 ms vs 11.7-12.6,
// 512 tokens 32.5-36.3 vs 45.2-46.5; from 1,024 tokens on, within noise. Sums are unchanged:
// each output still adds k = 0..K-1 in order, so results are bit-identical to before.
inline float* panel_at(float* packed, int64_t row, int64_t k_size) {
  return packed + (row / kMR) * k_size * kMR + row % kMR;
}

// c_rows[r][col : col + 16] = scale[r] * (A[r, :K] . panel) for r < MR; A is one packed
// micro-panel ([K][6], rows past MR unused).
template <int MR>
inline void micro(const float* a, const float* panel, int64_t k_size, float* const* c_rows,
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

// C = A [m, K] @ W^T, A in micro-panels (`panel_at`), W packed [N / 16][K][16]; row r of C at
// c_rows[r], scaled by scale[r] when scale is not null.
void gemm(const float* a, int64_t m, int64_t k_size, const float* packed, int64_t n,
          float* const* c_rows, const float* scale) {
  for (int64_t p = 0; p < n / kPanel; ++p) {
    const float* panel = packed + p * k_size * kPanel;
    const int64_t col = p * kPanel;
    int64_t i = 0;
    for (; i + kMR <= m; i += kMR)
      micro<kMR>(a + i * k_size, panel, k_size, c_rows + i, col, scale ? scale + i : nullptr);
    const float* s = scale ? scale + i : nullptr;
    const float* ai = a + i * k_size;
    switch (m - i) {
      case 1: micro<1>(ai, panel, k_size, c_rows + i, col, s); break;
      case 2: micro<2>(ai, panel, k_size, c_rows + i, col, s); break;
      case 3: micro<3>(ai, panel, k_size, c_rows + i, col, s); break;
      case 4: micro<4>(ai, panel, k_size, c_rows + i, col, s); break;
      case 5: micro<5>(ai, panel, k_size, c_rows + i, col, s); break;
      default: break;
    }
  }
}

}  // namespace

extern "C" int batchgen_fused_moe_silu_f32(const float* x, const float* w13p, const float* w2p,
                                           const float* topk_weights, const int64_t* order,
                                           const int64_t* starts, float* y_slots, float* out,
                                           int64_t num_tokens, int64_t hidden, int64_t inter,
                                           int64_t top_k, int64_t num_experts,
                                           int64_t num_threads) {
  if (hidden % kPanel != 0 || (2 * inter) % kPanel != 0 || top_k <= 0) return 1;
  const int64_t h = hidden, i2 = 2 * inter;
  num_threads = std::max<int64_t>(1, num_threads);
#pragma omp parallel num_threads(num_threads)
  {
    // Per-thread scratch kept across calls (OpenMP reuses its threads): no fresh pages per call.
    // a_buf and act hold micro-panels (`panel_at`): kRowChunk rows rounded up to whole panels.
    constexpr int64_t kPanelRows = (kRowChunk + kMR - 1) / kMR * kMR;
    thread_local std::vector<float> a_buf, g_buf, act;
    thread_local std::vector<float> scale(kRowChunk);
    thread_local std::vector<float*> g_rows(kRowChunk), y_rows(kRowChunk);
    if (a_buf.size() < static_cast<size_t>(kPanelRows * h)) a_buf.resize(kPanelRows * h);
    if (g_buf.size() < static_cast<size_t>(kRowChunk * i2)) g_buf.resize(kRowChunk * i2);
    if (act.size() < static_cast<size_t>(kPanelRows * inter)) act.resize(kPanelRows * inter);
    for (int64_t r = 0; r < kRowChunk; ++r) g_rows[r] = g_buf.data() + r * i2;
#pragma omp for schedule(dynamic, 1)
    for (int64_t e = 0; e < num_experts; ++e) {
      const float* w13 = w13p + e * i2 * h;
      const float* w2 = w2p + e * h * inter;
      // Rows in chunks of at most kRowChunk, of about equal size (no short last chunk that
      // would stream the weights again for a few rows).
      const int64_t rows = starts[e + 1] - starts[e];
      const int64_t chunks = (rows + kRowChunk - 1) / kRowChunk;
      const int64_t chunk = chunks ? (rows + chunks - 1) / chunks : 0;
      for (int64_t r0 = starts[e]; r0 < starts[e + 1]; r0 += chunk) {
        const int64_t m = std::min(chunk, starts[e + 1] - r0);
        for (int64_t r = 0; r < m; ++r) {
          const int64_t slot = order[r0 + r];
          const float* src = x + (slot / top_k) * h;
          float* dst = panel_at(a_buf.data(), r, h);
          for (int64_t k = 0; k < h; ++k) dst[k * kMR] = src[k];
          y_rows[r] = y_slots + slot * h;
          scale[r] = topk_weights[slot];
        }
        gemm(a_buf.data(), m, h, w13, i2, g_rows.data(), nullptr);  // [m, 2I]: gate, up
        for (int64_t r = 0; r < m; ++r) {
          const float* g = g_buf.data() + r * i2;
          float* o = panel_at(act.data(), r, inter);
#pragma omp simd
          for (int64_t j = 0; j < inter; ++j) {
            // exp's argument capped below float overflow (exp(88) = 1.65e38): under fast math
            // 1 / (1 + inf) is computed as rcp(inf) plus a Newton step, which gives NaN, not 0.
            const float e = std::exp(std::min(-g[j], 88.0f));
            o[j * kMR] = g[j] / (1.0f + e) * g[inter + j];
          }
        }
        gemm(act.data(), m, inter, w2, h, y_rows.data(), scale.data());  // weighted [m, H]
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

extern "C" int batchgen_fused_moe_supported() { return 1; }

#else  // no AVX2/FMA: the caller uses the torch path

extern "C" int batchgen_fused_moe_supported() { return 0; }

extern "C" int batchgen_fused_moe_silu_f32(const float*, const float*, const float*, const float*,
                                           const int64_t*, const int64_t*, float*, float*, int64_t,
                                           int64_t, int64_t, int64_t, int64_t, int64_t) {
  return 2;
}

#endif
