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
// Why: the eager module is eight small torch ops (cast, pow, mean, add, rsqrt, mul, cast, mul),
// about 40 us per call on a [70, 512] bf16 decode batch, nearly all dispatch; this is one call.
// Each row is computed alone, so a row's result does not depend on the other rows
// (batch-invariant). Rows are spread over OpenMP threads when there are enough of them; the
// library joins torch's OpenMP pool like the other kernels.
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) {
  const uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float round_to(float x, float) { return x; }
// x rounded to the nearest bf16 (ties to even), as a float32 (finite inputs).
inline float round_to(float x, uint16_t) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) {  // x is already a bf16 value
  uint32_t u;
  std::memcpy(&u, &x, 4);
  *p = uint16_t(u >> 16);
}

constexpr int64_t kLanes = 16;
constexpr int64_t kRowsPerThread = 16;  // fewer rows than this per thread: stay single-threaded

#if defined(__AVX512F__)
// 16 values as float32: float32 loads, bf16 widened exactly (bits shifted into the high half).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 round16(__m512 v, float) { return v; }
// To the nearest bf16, ties to even (the scalar round_to's integer rule), kept as float32.
inline __m512 round16(__m512 v, uint16_t) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd);
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(int(0xFFFF0000u))));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(uint16_t* p, __m512 v) {  // v holds bf16 values
  const __m512i hi = _mm512_srli_epi32(_mm512_castps_si512(v), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(hi));
}
#endif

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

}  // namespace

extern "C" int batchgen_rms_norm_f32(const float* x, const float* w, float* y, int64_t rows,
                                     int64_t h, float eps, int64_t threads) {
  return run(x, w, y, rows, h, eps, threads);
}

// x, w, y: bf16 bits (uint16).
extern "C" int batchgen_rms_norm_bf16(const uint16_t* x, const uint16_t* w, uint16_t* y,
                                      int64_t rows, int64_t h, float eps, int64_t threads) {
  return run(x, w, y, rows, h, eps, threads);
}
