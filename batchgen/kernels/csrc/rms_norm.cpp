// RMSNorm rows on CPU, float32 and bfloat16, in Hugging Face `LlamaRMSNorm`'s order of
// operations (Zhang & Sennrich 2019):
//
//   x32 = float32(x);  r = 1 / sqrt(mean(x32^2) + eps);  y = w * T(x32 * r)
//
// T is the input type (bf16: the normalised row rounded to bf16, round to nearest even, before
// the weight multiply; then w * that, computed in float32 and rounded to bf16 again, which is
// what torch does for a bf16 x bf16 product). x, w, y: [rows, H] / [H] / [rows, H], all of
// type T, contiguous. The only difference from torch's eager ops is the order of the sum of
// squares (torch's vectorised cascade sum, here 16-lane partial sums of fused multiply-adds
// added at the end; AVX-512 where H is a multiple of 16, else generic loops): the mean
// may differ in its last bit; r is computed as 1 / sqrt(.) with a correctly rounded square root
// and division (an asm barrier keeps -ffast-math from turning it into rsqrt + Newton, which is
// not correctly rounded).
//
// `batchgen_fused_add_rms_norm_*` is vLLM's fused_add_rms_norm: s = T(x + residual) (HF's
// residual add in the model dtype), then the same normalisation of s, in one pass per row.
//
// Why: the eager module is eight small torch ops (cast, pow, mean, add, rsqrt, mul, cast, mul),
// about 40 us per call on a [70, 512] bf16 decode batch, nearly all dispatch; this is one call.
// Each row is computed alone, so a row's result does not depend on the other rows
// (batch-invariant). Rows are spread over OpenMP threads when there are enough of them; the
// library joins torch's OpenMP pool like the other kernels.
#include <cmath>
#include <cstdint>

#include "bf16_rows.h"

namespace {

using namespace bgrows;

constexpr int64_t kLanes = 16;
constexpr int64_t kRowsPerThread = 16;  // fewer rows than this per thread: stay single-threaded

template <class T>
void norm_row(const T* x, const T* w, T* y, int64_t h, float eps) {
#if defined(__AVX512F__)
  if (h % kLanes == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < h; j += kLanes) {
      const __m512 v = load16(x + j);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    float s = std::sqrt(_mm512_reduce_add_ps(acc) / float(h) + eps);
    asm("" : "+x"(s));  // see below
    const __m512 r = _mm512_set1_ps(1.0f / s);
    const T tag{};
    for (int64_t j = 0; j < h; j += kLanes) {
      const __m512 n = round16(_mm512_mul_ps(load16(x + j), r), tag);
      store16(y + j, round16(_mm512_mul_ps(load16(w + j), n), tag));
    }
    return;
  }
#endif
  float part[kLanes] = {0};
  int64_t j = 0;
  for (; j + kLanes <= h; j += kLanes)
#pragma omp simd
    for (int64_t l = 0; l < kLanes; ++l) {
      const float v = to_f32(x[j + l]);
      part[l] += v * v;
    }
  float sum = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) sum += part[l];
  for (; j < h; ++j) sum += to_f32(x[j]) * to_f32(x[j]);
  float s = std::sqrt(sum / float(h) + eps);
  asm("" : "+x"(s));  // no rsqrt approximation: 1 / sqrt correctly rounded, as torch.rsqrt
  const float r = 1.0f / s;
  const T tag{};
#pragma omp simd
  for (int64_t k = 0; k < h; ++k) {
    const float n = round_to(to_f32(x[k]) * r, tag);
    store(y + k, round_to(to_f32(w[k]) * n, tag));
  }
}

template <class T>
int run(const T* x, const T* w, T* y, int64_t rows, int64_t h, float eps, int64_t threads) {
  if (rows < 0 || h <= 0) return 1;
  const int64_t use = rows >= 2 * kRowsPerThread ? threads : 1;
#pragma omp parallel for num_threads(use) schedule(static) if (use > 1)
  for (int64_t i = 0; i < rows; ++i) norm_row(x + i * h, w, y + i * h, h, eps);
  return 0;
}

// vLLM's fused_add_rms_norm for one row: s = T(x + r) (torch's add: float32 sum rounded to
// T) into r_out, then y = norm_row(s): bit for bit rms_norm of the sum. r_out may be r, y may
// be x (in place).
template <class T>
void add_norm_row(const T* x, const T* r, T* r_out, const T* w, T* y, int64_t h, float eps) {
  const T tag{};
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + kLanes <= h; j += kLanes)
    store16(r_out + j, round16(_mm512_add_ps(load16(x + j), load16(r + j)), tag));
#endif
  for (; j < h; ++j) store(r_out + j, round_to(to_f32(x[j]) + to_f32(r[j]), tag));
  norm_row(r_out, w, y, h, eps);
}

template <class T>
int run_add(const T* x, const T* r, T* r_out, const T* w, T* y, int64_t rows, int64_t h,
            float eps, int64_t threads) {
  if (rows < 0 || h <= 0) return 1;
  const int64_t use = rows >= 2 * kRowsPerThread ? threads : 1;
#pragma omp parallel for num_threads(use) schedule(static) if (use > 1)
  for (int64_t i = 0; i < rows; ++i)
    add_norm_row(x + i * h, r + i * h, r_out + i * h, w, y + i * h, h, eps);
  return 0;
}

}  // namespace

extern "C" int batchgen_fused_add_rms_norm_f32(const float* x, const float* r, float* r_out,
                                               const float* w, float* y, int64_t rows,
                                               int64_t h, float eps, int64_t threads) {
  return run_add(x, r, r_out, w, y, rows, h, eps, threads);
}

// All bf16 bits (uint16).
extern "C" int batchgen_fused_add_rms_norm_bf16(const uint16_t* x, const uint16_t* r,
                                                uint16_t* r_out, const uint16_t* w, uint16_t* y,
                                                int64_t rows, int64_t h, float eps,
                                                int64_t threads) {
  return run_add(x, r, r_out, w, y, rows, h, eps, threads);
}

extern "C" int batchgen_rms_norm_f32(const float* x, const float* w, float* y, int64_t rows,
                                     int64_t h, float eps, int64_t threads) {
  return run(x, w, y, rows, h, eps, threads);
}

// x, w, y: bf16 bits (uint16).
extern "C" int batchgen_rms_norm_bf16(const uint16_t* x, const uint16_t* w, uint16_t* y,
                                      int64_t rows, int64_t h, float eps, int64_t threads) {
  return run(x, w, y, rows, h, eps, threads);
}
