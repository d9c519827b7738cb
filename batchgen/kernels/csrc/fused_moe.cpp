// Fused MoE experts on CPU, SiLU-gated (Mixtral, Qwen-MoE, OLMoE, DeepSeek experts):
//   out[t] = sum_a topk_weights[t, a] * W2_e (silu(W1_e x_t) * (W3_e x_t)),  e = topk_ids[t, a]
// in one call: each expert gathers its rows, runs its two GEMMs with a micro-kernel on weights
// packed once ahead of time, applies the activation, and writes its weighted output rows into
// a per-(token, slot) float32 buffer; a last pass sums each token's slots in slot order (the
// order of `fused_experts_reference`'s sum over the top-k). This file is the driver; the
// micro-kernels are in fused_moe_f32.h, fused_moe_bf16.h and fused_moe_amx.h (its tile
// configuration and the OS permission in amx_bf16.h, shared with the dense packed_linear.cpp).
//
// Two entry points:
//   batchgen_fused_moe_silu_f32:  float32 weights and activations. Micro-kernel chosen at
//     compile time (-march=native): AVX-512F (12 rows x 32 columns in 24 zmm accumulators,
//     the shape of BLIS's SkylakeX sgemm) where __AVX512F__ is defined, else AVX2/FMA (6 x 16
//     in 12 ymm, BLIS's Haswell shape). `isa` = 1 forces the AVX2 kernel (A/B measurements).
//   batchgen_fused_moe_silu_bf16: bfloat16 weights and activations, float32 accumulation,
//     micro-kernel chosen at run time: AMX-BF16 (tdpbf16ps, 2 x 2 tiles of 16 x 16) where the
//     CPU has it and the OS grants the tile state, else AVX512-BF16's vdpbf16ps (12 x 32, two
//     k per instruction). Both are compiled with target attributes, so the library builds on
//     any x86-64 CPU; batchgen_fused_moe_bf16_supported() says which one this CPU runs.
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
//   [K / 2][16][2]: pairs of k interleaved per column, the operand layout of vdpbf16ps and of
//   an AMX B tile (16 k pairs x 16 columns).
//   topk_weights [T * A] float32; order [T * A]: the flat (t, a) slot of each sorted row,
//   grouped by expert; starts [E + 1]: expert e's rows are order[starts[e] : starts[e + 1]];
//   y_slots [T * A, H] float32 scratch; out [T, H] float32.
//
// Every micro-kernel sums each output over k in one fixed order whatever the number of rows
// (one accumulator per output, k = 0, 1, ...; vdpbf16ps adds the pair (k, k + 1) to it, AMX a
// tile of 32 k), so a token's result does not depend on which other tokens share its expert
// call (batch-invariant). The AVX2 and AVX-512 float32 kernels run the same FMA chain per
// output: their results are bit-identical. The two bf16 kernels are not (AMX sums 32 products
// per tile step); both are within the same bound of the exact result.
//
// bf16 numerics: gate/up are float32 sums of exact bf16 x bf16 products; silu(gate) * up is
// computed in float32 and rounded once to bf16 (round to nearest even) as the down GEMM's
// input; the down GEMM, the router weighting and the slot sum are float32. The torch path
// rounds gate, up, silu(gate), their product and the down output to bf16 instead.
// vdpbf16ps and tdpbf16ps treat bf16 subnormal inputs as zero and flush subnormal results.
// The bf16 activation is silu_mul_to_bf16_pairs (fused_moe_bf16.h: libmvec's 16-lane expf);
// AMX computes it in the gate/up GEMM's epilogue (AmxBf16::gemm_silu), the vdpbf16ps kernel
// in a pass over float32 rows: the same function of the same float32 sums. Both bf16 kernels
// and the AVX-512 float32 one write the down GEMM's weighted rows into y_slots with
// non-temporal stores when the buffer is larger than kStreamMinBytes (it is read only by the
// slot-sum pass and is far larger than the caches at large calls), with regular stores below
// (the slot sum then reads it back from the caches, not from memory).
//
// Experts are spread over OpenMP threads (dynamic: experts differ in rows); the library joins
// torch's OpenMP runtime like paged_decode_attention.cpp.
#include "fused_moe_amx.h"
#include "fused_moe_bf16.h"
#include "fused_moe_common.h"
#include "fused_moe_f32.h"

namespace {

// n float32 values -> bf16 bits, round to nearest even; NaN -> 0xFFFF, as torch 2.13's CPU
// .to(bfloat16) writes it (measured; the test on the bits, as -ffast-math lets the compiler
// assume there is no NaN).
inline void store_bf16_rne(const float* src, uint16_t* dst, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    uint32_t u;
    std::memcpy(&u, src + j, 4);
    const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    dst[j] = nan ? uint16_t{0xFFFF} : uint16_t(r);
  }
}

// The layer, for one micro-kernel K (Avx2F32, Avx512F32, Avx512Bf16 or AmxBf16).
template <class K>
int run_experts(const typename K::In* x, const typename K::In* w13p, const typename K::In* w2p,
                const float* topk_weights, const int64_t* order, const int64_t* starts,
                float* y_slots, float* out, int64_t num_tokens, int64_t hidden, int64_t inter,
                int64_t top_k, int64_t num_experts, int64_t num_threads,
                uint16_t* out_bf16 = nullptr) {
  using In = typename K::In;
  constexpr int MR = K::kMR;
  constexpr int64_t kRowChunk = K::kRowChunk;
  constexpr int64_t kStep = K::kStep;
  if (hidden % kPanel != 0 || (2 * inter) % kPanel != 0 || top_k <= 0) return 1;
  const int64_t h = hidden, i2 = 2 * inter;
  // order indexes x (by token) and y_slots (by slot): each of the T x top_k rows exactly once,
  // or a row would be read or written out of bounds, or left holding a previous call's values.
  {
    const int64_t rows = num_tokens * top_k;
    if (starts[0] != 0 || starts[num_experts] != rows) return 3;
    std::vector<uint8_t> seen(rows, 0);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t slot = order[r];
      if (slot < 0 || slot >= rows || seen[slot]) return 3;
      seen[slot] = 1;
    }
  }
  num_threads = std::max<int64_t>(1, num_threads);
  // Non-temporal stores into y_slots only when it outgrows the caches (the bf16 kernels'
  // StoreRows says why); a choice per call, so every row's value is the same either way.
  const bool stream_y = num_tokens * top_k * h * int64_t{sizeof(float)} > kStreamMinBytes;
  // The weight prefetch of this CPU (WeightPrefetch, fused_moe_common.h): also one per call.
  const WeightPrefetch pf = K::moe_prefetch();
#pragma omp parallel num_threads(num_threads)
  {
    // Per-thread scratch kept across calls (OpenMP reuses its threads): no fresh pages per call.
    // a_buf and act hold kRowChunk rows rounded up to whole row blocks, in K's layout.
    constexpr int64_t kPanelRows = (kRowChunk + MR - 1) / MR * MR;
    // bf16: cache-line aligned (AMX tile rows); float32: as before.
    using InBuffer = std::conditional_t<sizeof(In) == 2, std::vector<In, CacheAligned<In>>,
                                        std::vector<In>>;
    thread_local InBuffer a_buf, act;
    thread_local std::vector<float> g_buf;
    thread_local std::vector<float> scale(kRowChunk);
    thread_local std::vector<float*> g_rows(kRowChunk), y_rows(kRowChunk);
    if (a_buf.size() < static_cast<size_t>(kPanelRows * h)) a_buf.resize(kPanelRows * h);
    if (!K::kFusedSilu && g_buf.size() < static_cast<size_t>(kRowChunk * i2))
      g_buf.resize(kRowChunk * i2);
    if (act.size() < static_cast<size_t>(kPanelRows * inter)) act.resize(kPanelRows * inter);
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
          In* dst = a_buf.data() + K::row_offset(r, h);
          if constexpr (sizeof(In) == 4) {
            for (int64_t k = 0; k < h; ++k) dst[k * kStep] = src[k];
          } else {  // bf16 pairs as 32-bit words
            uint32_t* d32 = reinterpret_cast<uint32_t*>(dst);
            const uint32_t* s32 = reinterpret_cast<const uint32_t*>(src);
            for (int64_t k = 0; k < h / 2; ++k) d32[k * kStep] = s32[k];
          }
          y_rows[r] = y_slots + slot * h;
          scale[r] = topk_weights[slot];
        }
        const int64_t m_pad = (m + MR - 1) / MR * MR;
        if constexpr (K::kZeroPadRows)  // row-major: rows m .. m_pad - 1 are one range
          std::fill(a_buf.data() + m * h, a_buf.data() + m_pad * h, In{0});
        if constexpr (K::kFusedSilu) {  // [m, I] bf16 straight from the GEMM's tiles
          K::gemm_silu(a_buf.data(), m, h, w13, inter, act.data());
        } else {
          K::gemm(a_buf.data(), m, h, w13, i2, g_rows.data(), nullptr, false, pf);  // [m, 2I]
          for (int64_t r = 0; r < m; ++r) {
            const float* g = g_buf.data() + r * i2;
            In* o = act.data() + K::row_offset(r, inter);
            // exp's argument capped below float overflow (exp(88) = 1.65e38): under fast math
            // 1 / (1 + inf) is computed as rcp(inf) plus a Newton step, which gives NaN, not 0.
            if constexpr (sizeof(In) == 4) {
#pragma omp simd
              for (int64_t j = 0; j < inter; ++j) {
                const float ex = std::exp(std::min(-g[j], 88.0f));
                o[j * kStep] = g[j] / (1.0f + ex) * g[inter + j];
              }
            } else {  // 16 lanes of AVX-512, rounded into bf16 pairs (fused_moe_bf16.h)
#if BATCHGEN_HAVE_BF16
              silu_mul_to_bf16_pairs(g, g + inter, inter, reinterpret_cast<uint32_t*>(o), kStep);
#endif
            }
          }
        }
        if constexpr (K::kZeroPadRows)
          std::fill(act.data() + m * inter, act.data() + m_pad * inter, In{0});
        K::gemm(act.data(), m, inter, w2, h, y_rows.data(), scale.data(), stream_y, pf);  // [m, H]
      }
    }
    // Each token's slots, summed in slot order (float32). With out_bf16 the sum goes through a
    // per-thread row and is rounded once into bf16, the same bits as torch's .to(bfloat16) of
    // the float32 result (no separate cast pass over [T, H]).
    thread_local std::vector<float> sum_row;
    if (out_bf16 != nullptr && sum_row.size() < static_cast<size_t>(h)) sum_row.resize(h);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t) {
      float* o = out_bf16 != nullptr ? sum_row.data() : out + t * h;
      const float* y = y_slots + t * top_k * h;
      std::copy(y, y + h, o);
      for (int64_t a = 1; a < top_k; ++a) {
#pragma omp simd
        for (int64_t j = 0; j < h; ++j) o[j] += y[a * h + j];
      }
      if (out_bf16 != nullptr) store_bf16_rne(o, out_bf16 + t * h, h);
    }
  }
  return 0;
}

}  // namespace

// isa: 0 = the best float32 kernel this build has, 1 = the AVX2 one (for A/B measurements).
// Returns 0, or 1 (shapes not multiples of 16 / top_k <= 0), 2 (no such kernel in this build),
// 3 (order is not a permutation of the num_tokens x top_k rows; starts do not cover them).
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

// x, w13p, w2p: bf16 bits (uint16); everything else as for float32, except out: [T, H] float32, or
// bf16 bits when out_is_bf16 (the float32 slot sum rounded to nearest even). isa: 0 = the best
// kernel for this CPU and these shapes (AMX where usable and H and I are multiples of 32, else
// vdpbf16ps), 1 = vdpbf16ps, 2 = AMX (returns 2 where AMX is not usable, 1 where H or I is not a
// multiple of 32). The choice is per call, never per row count: batch-invariant.
extern "C" int batchgen_fused_moe_silu_bf16_out(const uint16_t* x, const uint16_t* w13p,
                                            const uint16_t* w2p, const float* topk_weights,
                                            const int64_t* order, const int64_t* starts,
                                            float* y_slots, void* out, int64_t num_tokens,
                                            int64_t hidden, int64_t inter, int64_t top_k,
                                            int64_t num_experts, int64_t num_threads,
                                            int64_t isa, int64_t out_is_bf16) {
#if BATCHGEN_HAVE_BF16
  float* out_f32 = out_is_bf16 ? nullptr : static_cast<float*>(out);
  uint16_t* out_bf16 = out_is_bf16 ? static_cast<uint16_t*>(out) : nullptr;
  const int supported = batchgen_fused_moe_bf16_supported();
  if (supported == 0 || isa < 0 || isa > 2 || (isa == 2 && supported != 2)) return 2;
#if BATCHGEN_HAVE_AMX
  const bool amx_shapes = AmxBf16::usable(hidden) && AmxBf16::usable(inter);
  if (isa == 2 && !amx_shapes) return 1;
  if (supported == 2 && isa != 1 && amx_shapes)
    return run_experts<AmxBf16>(x, w13p, w2p, topk_weights, order, starts, y_slots, out_f32,
                                num_tokens, hidden, inter, top_k, num_experts, num_threads,
                                out_bf16);
#endif
  return run_experts<Avx512Bf16>(x, w13p, w2p, topk_weights, order, starts, y_slots, out_f32,
                                 num_tokens, hidden, inter, top_k, num_experts, num_threads,
                                 out_bf16);
#else
  (void)x, (void)w13p, (void)w2p, (void)topk_weights, (void)order, (void)starts;
  (void)y_slots, (void)out, (void)num_tokens, (void)hidden, (void)inter, (void)top_k;
  (void)num_experts, (void)num_threads, (void)isa, (void)out_is_bf16;
  return 2;
#endif
}

// The float32-output entry, its signature unchanged (benchmarks/fused_moe_ab.py builds older
// revisions and calls both with it).
extern "C" int batchgen_fused_moe_silu_bf16(const uint16_t* x, const uint16_t* w13p,
                                            const uint16_t* w2p, const float* topk_weights,
                                            const int64_t* order, const int64_t* starts,
                                            float* y_slots, float* out, int64_t num_tokens,
                                            int64_t hidden, int64_t inter, int64_t top_k,
                                            int64_t num_experts, int64_t num_threads,
                                            int64_t isa) {
  return batchgen_fused_moe_silu_bf16_out(x, w13p, w2p, topk_weights, order, starts, y_slots,
                                          out, num_tokens, hidden, inter, top_k, num_experts,
                                          num_threads, isa, 0);
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

// The best bf16 micro-kernel this CPU runs: 2 = AMX-BF16 (the CPU has amx_tile, amx_bf16 and
// avx512_bf16 and the OS granted the tile data), 1 = vdpbf16ps (avx512_bf16 and avx512f),
// 0 = none. The AMX check asks the OS once per process; the caller logs the answer.
extern "C" int batchgen_fused_moe_bf16_supported() {
#if BATCHGEN_HAVE_BF16
  __builtin_cpu_init();  // idempotent; safe however early the library is loaded
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bf16")) return 0;
  return amx_usable() ? 2 : 1;
#else
  return 0;
#endif
}
