// Dense linear layer in bfloat16 on a weight packed once: out[M, N] = x[M, K] . W^T (+ bias),
// float32 accumulation, one rounding to bf16 (round to nearest even) after the bias add.
//
// Why: at the row counts of decode steps (1 to a few hundred rows) and hidden sizes of a few
// hundred to a few thousand, the cost of oneDNN's prepacked inner product
// (torch.ops.mkldnn._linear_pointwise) is its per-call work (primitive lookup, format checks,
// scratchpad), not FLOPs. vLLM's CPU backend runs these projections on SGLang's CPU
// weight_packed_linear (AMX on a weight packed once); this is the same design on the fused MoE
// kernel's micro-kernels (amx_bf16.h, fused_moe_bf16.h): blocks of 2 x 2 AMX tiles
// (32 rows x 32 columns, as SGLang's block_size_m / block_size_n), with row tails configured
// as shorter tiles instead of being copied into zero-padded rows.
//
// Layouts: x [M, ldx] bf16 bits (row-major, the first K of each row used); wp
// [Np / 16][Kp / 2][16][2] bf16 (the [N, K] weight cut into panels of 16 output columns, k
// pairs interleaved per column, zero columns padding N up to Np and zero k padding K up to Kp,
// a multiple of 32); bias [N] bf16 or null; out [M, N] bf16, contiguous.
//
// Micro-kernels, chosen per call by `isa` (never by M, so a row's result does not depend on
// the number of rows): AMX-BF16 (tdpbf16ps; 32 products per step) where the OS grants the tile
// state, else AVX512-BF16 (vdpbf16ps, 12 x 32, rows packed into micro-panels per task). The two
// sum in different orders; both are within one bf16 rounding of the exact product plus float32
// summation error. Both treat bf16 subnormal inputs as zero and flush subnormal results.
//
// Work: tasks of kBlockM rows x kBlockN columns, row block major, spread statically over
// OpenMP threads (joining torch's runtime like the other kernels), at most one thread per
// kMinMacsPerThread of work; no parallel region for one thread.
#include "amx_bf16.h"
#include "fused_moe_bf16.h"
#include "fused_moe_common.h"

namespace {

constexpr int64_t kBlockM = 128;  // rows per task (a 128 x 512 bf16 A block is 128 KiB: L2)
constexpr int64_t kBlockN = 64;   // columns per task (4 panels, two AMX column blocks)
// Fewest multiply-adds per thread: a call of M N K below 2 kMinMacsPerThread runs on one
// thread. 4 M multiply-adds are about 8 us of AMX work, against 1-2 us to start and join a
// parallel region, and a thread descheduled on a busy machine holds the whole call at the
// final barrier (measured: calls of 64-512 rows at 2 threads taking 5 ms instead of 20-150 us
// while other jobs ran), so small calls stay on the caller's thread.
constexpr int64_t kMinMacsPerThread = int64_t{1} << 22;

#if BATCHGEN_HAVE_BF16
#define BATCHGEN_STORE_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// dst[0 : valid] = bf16(acc[0 : valid] + bias[0 : valid]) (bias null: no add), valid <= 16.
BATCHGEN_STORE_TARGET inline void store_bf16(const float* acc, const uint16_t* bias,
                                             uint16_t* dst, int64_t valid) {
  const __mmask16 mask = valid >= 16 ? __mmask16(0xffff) : __mmask16((1u << valid) - 1);
  __m512 v = _mm512_maskz_loadu_ps(mask, acc);
  if (bias != nullptr) {
    const __m512i b16 = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias));
    v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(b16, 16)));
  }
  const __m256i out = (__m256i)_mm512_cvtneps_pbh(v);
  _mm256_mask_storeu_epi16(dst, mask, out);
}

struct Args {
  const uint16_t* x;
  int64_t ldx;
  const uint16_t* wp;
  const uint16_t* bias;
  uint16_t* out;
  int64_t m, k, kp, n;
};

// Rows r0 .. r0 + rows of x, each padded with zeros from K to Kp, into dst (stride Kp).
inline void copy_rows_padded(const Args& g, int64_t r0, int64_t rows, uint16_t* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(dst + r * g.kp, g.x + (r0 + r) * g.ldx, g.k * sizeof(uint16_t));
    std::fill(dst + r * g.kp + g.k, dst + (r + 1) * g.kp, uint16_t{0});
  }
}
#endif

#if BATCHGEN_HAVE_AMX
// One task on AMX: rows [r0, r1), panels [p0, p1). `cfg` holds the row counts this thread's
// tile state is configured for (reloaded only when a block needs other ones).
BATCHGEN_AMX_TARGET void amx_task(const Args& g, int64_t r0, int64_t r1, int64_t p0, int64_t p1,
                                  uint16_t* a_buf, int* cfg) {
  alignas(64) float cbuf[4 * 256];
  for (int64_t i = r0; i < r1; i += 32) {
    const int64_t rows = std::min<int64_t>(32, r1 - i);
    const int mt = rows > 16 ? 2 : 1;
    const int lo = mt == 2 ? 16 : static_cast<int>(rows);
    const int hi = mt == 2 ? static_cast<int>(rows - 16) : 16;
    if (cfg[0] != lo || cfg[1] != hi) {
      amx_tile_config(lo, hi);
      cfg[0] = lo, cfg[1] = hi;
    }
    const uint16_t* a = g.x + i * g.ldx;
    int64_t lda = g.ldx;
    if (g.k != g.kp) {  // K not a multiple of 32: the tiles would read past each row
      copy_rows_padded(g, i, rows, a_buf);
      a = a_buf, lda = g.kp;
    }
    for (int64_t p = p0; p < p1; p += 2) {
      const int nt = p1 - p >= 2 ? 2 : 1;
      amx_block_any(mt, nt, a, lda, g.kp, g.wp + p * g.kp * kPanel, cbuf);
      for (int tm = 0; tm < mt; ++tm)
        for (int64_t r = 0; r < 16 && 16 * tm + r < rows; ++r)
          for (int tn = 0; tn < nt; ++tn) {
            const int64_t col = (p + tn) * kPanel;
            if (col >= g.n) continue;
            store_bf16(cbuf + (2 * tm + tn) * 256 + r * 16,
                       g.bias != nullptr ? g.bias + col : nullptr,
                       g.out + (i + 16 * tm + r) * g.n + col, g.n - col);
          }
    }
  }
}
#endif

#if BATCHGEN_HAVE_BF16
// One task on vdpbf16ps: rows [r0, r1) packed into Avx512Bf16's micro-panels, then its gemm
// over panels [p0, p1) into float32 rows, then the bias and the rounding.
BATCHGEN_BF16_TARGET void vnni_task(const Args& g, int64_t r0, int64_t r1, int64_t p0,
                                    int64_t p1, uint16_t* a_buf, float* c_buf) {
  const int64_t rows = r1 - r0, cols = (p1 - p0) * kPanel;
  for (int64_t r = 0; r < rows; ++r) {
    uint32_t* d32 = reinterpret_cast<uint32_t*>(a_buf + Avx512Bf16::row_offset(r, g.kp));
    const uint32_t* s32 = reinterpret_cast<const uint32_t*>(g.x + (r0 + r) * g.ldx);
    const int64_t pairs = g.k / 2;
    for (int64_t j = 0; j < pairs; ++j) d32[j * Avx512Bf16::kStep] = s32[j];
    if (g.k % 2) d32[pairs * Avx512Bf16::kStep] = g.x[(r0 + r) * g.ldx + g.k - 1];
    for (int64_t j = (g.k + 1) / 2; j < g.kp / 2; ++j) d32[j * Avx512Bf16::kStep] = 0;
  }
  float* c_rows[kBlockM];
  for (int64_t r = 0; r < rows; ++r) c_rows[r] = c_buf + r * kBlockN;
  Avx512Bf16::gemm(a_buf, rows, g.kp, g.wp + p0 * g.kp * kPanel, cols, c_rows, nullptr);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols && p0 * kPanel + c < g.n; c += kPanel) {
      const int64_t col = p0 * kPanel + c;
      store_bf16(c_rows[r] + c, g.bias != nullptr ? g.bias + col : nullptr,
                 g.out + (r0 + r) * g.n + col, g.n - col);
    }
}
#endif

}  // namespace

extern "C" int batchgen_packed_linear_bf16_supported();

// isa: 0 = the best kernel here (AMX where usable, else vdpbf16ps), 1 = vdpbf16ps, 2 = AMX.
// Returns 0; 1 for bad shapes (kp not a multiple of 32 or below k, ldx below k, n < 1, m < 0);
// 2 when the kernel asked for is not available here.
extern "C" int batchgen_packed_linear_bf16(const uint16_t* x, int64_t ldx, const uint16_t* wp,
                                           const uint16_t* bias, uint16_t* out, int64_t m,
                                           int64_t k, int64_t kp, int64_t n,
                                           int64_t num_threads, int64_t isa) {
  if (kp % 32 != 0 || kp < k || k < 1 || ldx < k || n < 1 || m < 0) return 1;
#if BATCHGEN_HAVE_BF16
  const int supported = batchgen_packed_linear_bf16_supported();
  if (supported == 0 || isa < 0 || isa > 2 || (isa == 2 && supported != 2)) return 2;
  const bool amx = supported == 2 && isa != 1;
  const Args g{x, ldx, wp, bias, out, m, k, kp, n};
  const int64_t panels = (n + kPanel - 1) / kPanel;
  constexpr int64_t kPanelsPerTask = kBlockN / kPanel;
  const int64_t row_blocks = (m + kBlockM - 1) / kBlockM;
  const int64_t col_blocks = (panels + kPanelsPerTask - 1) / kPanelsPerTask;
  const int64_t tasks = row_blocks * col_blocks;
  const int64_t by_work = m * n * k / kMinMacsPerThread;
  num_threads = std::max<int64_t>(1, std::min({num_threads, tasks, by_work}));
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    // Per-thread scratch kept across calls (OpenMP reuses its threads).
    thread_local std::vector<uint16_t> a_buf;
    thread_local std::vector<float> c_buf;
    const size_t a_need = static_cast<size_t>((amx ? 32 : kBlockM + 12) * kp);
    if (a_buf.size() < a_need) a_buf.resize(a_need);
    if (!amx && c_buf.size() < static_cast<size_t>(kBlockM * kBlockN))
      c_buf.resize(kBlockM * kBlockN);
    int cfg[2] = {0, 0};
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t r0 = (t / col_blocks) * kBlockM, r1 = std::min(m, r0 + kBlockM);
      const int64_t p0 = (t % col_blocks) * kPanelsPerTask;
      const int64_t p1 = std::min(panels, p0 + kPanelsPerTask);
#if BATCHGEN_HAVE_AMX
      if (amx) {
        amx_task(g, r0, r1, p0, p1, a_buf.data(), cfg);
        continue;
      }
#endif
      vnni_task(g, r0, r1, p0, p1, a_buf.data(), c_buf.data());
    }
#if BATCHGEN_HAVE_AMX
    if (cfg[0] != 0) amx_tile_release();
#endif
  }
  return 0;
#else
  (void)x, (void)wp, (void)bias, (void)out, (void)num_threads, (void)isa;
  return 2;
#endif
}

// The best micro-kernel this CPU runs: 2 = AMX-BF16 (the CPU has it and the OS granted the
// tile data), 1 = vdpbf16ps (avx512f, avx512bw, avx512vl and avx512_bf16), 0 = none (the
// caller uses another path). The AMX check asks the OS once per process.
extern "C" int batchgen_packed_linear_bf16_supported() {
#if BATCHGEN_HAVE_BF16
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bf16") ||
      !__builtin_cpu_supports("avx512bw") || !__builtin_cpu_supports("avx512vl"))
    return 0;
  return amx_usable() ? 2 : 1;
#else
  return 0;
#endif
}
