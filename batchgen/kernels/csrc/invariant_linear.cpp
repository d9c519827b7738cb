// Batch-invariant dense linear layer on CPU, float32: out[M, Np] = x[M, K] @ W^T with W packed
// [Np / 16][K][16] (the [N, K] weight cut into panels of 16 output columns, each stored k-major,
// zero columns padding N up to Np; the layout of fused_moe.cpp's expert weights).
//
// Why: MKL's SGEMM (torch's F.linear on CPU) picks its code path and its blocking of K from the
// shape, so one row's output changes in the last bits with the number of rows M of the call
// (measured on this project's 2-core machine, torch 2.13: a row computed with M = 1 differs
// from the same row computed with M >= 2, and M = 2 from M >= 3 or M >= 16, depending on K).
// A token's logits then depend on what it is batched with. Here every output element is one
// sequential chain of FMAs over k = 0 .. K - 1 (the micro-kernel of fused_moe.cpp: 6 rows x 16
// columns in 12 __m256 accumulators), whatever M, the row's place in the call, the task split
// or the number of threads: the result of a row depends only on the row and the weight.
//
// Work is cut into tasks of up to kRowBlock rows x kPanelBlock panels, spread over OpenMP
// threads (joining torch's runtime like the other kernels); a task packs its rows into
// micro-panels ([K][6] per 6 rows, BLIS's layout) and runs the micro-kernel over its panels,
// K in fixed blocks (the same for every M, so the chains are the same too).
#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

constexpr int64_t kPanel = 16;       // output columns per packed panel
constexpr int kMR = 6;               // rows per micro-kernel call
constexpr int64_t kRowBlock = 96;    // rows per task (16 micro-panels)
constexpr int64_t kPanelBlock = 16;  // panels per task (256 output columns)
constexpr int64_t kKBlock = 256;     // reduction steps per pass over a panel block

// c[r * ldc + 0 .. 15] (+)= A[r, :kc] . panel for r < MR; A one packed micro-panel block
// ([kc][6]), panel [kc][16]. With `accumulate` the sums continue from c: storing and reloading
// a float32 accumulator is exact, so a K split into blocks keeps each output's single chain.
template <int MR>
inline void micro(const float* a, const float* panel, int64_t k_size, float* c, int64_t ldc,
                  bool accumulate) {
  __m256 c0[MR], c1[MR];
  for (int r = 0; r < MR; ++r) {
    c0[r] = accumulate ? _mm256_loadu_ps(c + r * ldc) : _mm256_setzero_ps();
    c1[r] = accumulate ? _mm256_loadu_ps(c + r * ldc + 8) : _mm256_setzero_ps();
  }
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
    _mm256_storeu_ps(c + r * ldc, c0[r]);
    _mm256_storeu_ps(c + r * ldc + 8, c1[r]);
  }
}

void micro_rows(int rows, const float* a, const float* panel, int64_t k_size, float* c,
                int64_t ldc, bool acc) {
  switch (rows) {
    case 6: micro<6>(a, panel, k_size, c, ldc, acc); break;
    case 5: micro<5>(a, panel, k_size, c, ldc, acc); break;
    case 4: micro<4>(a, panel, k_size, c, ldc, acc); break;
    case 3: micro<3>(a, panel, k_size, c, ldc, acc); break;
    case 2: micro<2>(a, panel, k_size, c, ldc, acc); break;
    case 1: micro<1>(a, panel, k_size, c, ldc, acc); break;
    default: break;
  }
}

}  // namespace

extern "C" int batchgen_invariant_linear_f32(const float* x, const float* wp, float* out,
                                             int64_t m, int64_t k_size, int64_t n_padded,
                                             int64_t num_threads) {
  if (n_padded % kPanel != 0 || m < 0 || k_size <= 0) return 1;
  const int64_t panels = n_padded / kPanel;
  const int64_t row_blocks = (m + kRowBlock - 1) / kRowBlock;
  const int64_t panel_blocks = (panels + kPanelBlock - 1) / kPanelBlock;
  const int64_t tasks = row_blocks * panel_blocks;
  num_threads = std::max<int64_t>(1, std::min(num_threads, tasks));
#pragma omp parallel num_threads(num_threads)
  {
    thread_local std::vector<float> a_buf;
    const size_t need = static_cast<size_t>(kRowBlock * k_size);
    if (a_buf.size() < need) a_buf.resize(need);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t r0 = (task / panel_blocks) * kRowBlock;
      const int64_t p0 = (task % panel_blocks) * kPanelBlock;
      const int64_t rows = std::min(kRowBlock, m - r0);
      const int64_t p1 = std::min(panels, p0 + kPanelBlock);
      // Pack rows r0 .. r0 + rows into micro-panels: row r at (r / 6) * K * 6 + k * 6 + r % 6.
      for (int64_t r = 0; r < rows; ++r) {
        const float* src = x + (r0 + r) * k_size;
        float* dst = a_buf.data() + (r / kMR) * k_size * kMR + r % kMR;
        for (int64_t k = 0; k < k_size; ++k) dst[k * kMR] = src[k];
      }
      // K in blocks of kKBlock: a block of one panel (16 KiB) stays in L1 while every
      // micro-panel of the task's rows passes over it.
      for (int64_t k0 = 0; k0 < k_size; k0 += kKBlock) {
        const int64_t kc = std::min(kKBlock, k_size - k0);
        for (int64_t p = p0; p < p1; ++p) {
          const float* panel = wp + p * k_size * kPanel + k0 * kPanel;
          for (int64_t i = 0; i < rows; i += kMR) {
            const int mr = static_cast<int>(std::min<int64_t>(kMR, rows - i));
            micro_rows(mr, a_buf.data() + i * k_size + k0 * kMR, panel, kc,
                       out + (r0 + i) * n_padded + p * kPanel, n_padded, k0 > 0);
          }
        }
      }
    }
  }
  return 0;
}

extern "C" int batchgen_invariant_linear_supported() { return 1; }

#else  // no AVX2/FMA: the caller computes row by row instead

extern "C" int batchgen_invariant_linear_supported() { return 0; }

extern "C" int batchgen_invariant_linear_f32(const float*, const float*, float*, int64_t, int64_t,
                                             int64_t, int64_t) {
  return 2;
}

#endif
