// Rotary position embedding (Su et al. 2021, RoFormer), "rotate half" layout, applied in place
// to the query and key heads of a token, float32 and bfloat16, in Hugging Face's order of
// operations and roundings (`apply_rotary_pos_emb`: q * cos + rotate_half(q) * sin):
//
//   x = [x1, x2] (two halves of D / 2);  rotate_half(x) = [-x2, x1]
//   y1 = T(T(x1 * cos1) + T(-x2 * sin1));  y2 = T(T(x2 * cos2) + T(x1 * sin2))
//
// T rounds to the storage type (bf16: round to nearest even; float32: nothing), each product and
// sum computed in float32 as torch's eager ops compute them, so the result is torch's bit for bit
// (no fused multiply-add: an asm barrier keeps -ffast-math from contracting the product into
// the add). cos / sin: [T, D] of the storage type (the engine's once-per-step cache).
// q: rows of Hq heads of D values, row stride q_stride elements, heads adjacent; k likewise.
//
// Why: the eager form is ten torch ops per layer (two mul, neg, cat, mul, add for q and for k),
// about 50 us on a 70-token decode batch, nearly all dispatch; this is one call.
#include <cstdint>
#include <cstring>

#include "bf16_rows.h"

namespace {

using namespace bgrows;

constexpr int64_t kRowsPerThread = 32;

template <class T>
void rotate_head(T* x, const T* c, const T* s, int64_t d) {
  const int64_t half = d / 2;
  const T tag{};
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= half; j += 16) {
    const __m512 x1 = load16(x + j), x2 = load16(x + half + j);
    __m512 a1 = round16(_mm512_mul_ps(x1, load16(c + j)), tag);
    __m512 b1 = round16(_mm512_mul_ps(x2, load16(s + j)), tag);
    __m512 a2 = round16(_mm512_mul_ps(x2, load16(c + half + j)), tag);
    __m512 b2 = round16(_mm512_mul_ps(x1, load16(s + half + j)), tag);
    asm("" : "+v"(a1), "+v"(b1), "+v"(a2), "+v"(b2));  // no contraction into the sums
    store16(x + j, round16(_mm512_sub_ps(a1, b1), tag));
    store16(x + half + j, round16(_mm512_add_ps(a2, b2), tag));
  }
#endif
  for (; j < half; ++j) {
    const float x1 = to_f32(x[j]), x2 = to_f32(x[half + j]);
    float a1 = round_to(x1 * to_f32(c[j]), tag), b1 = round_to(x2 * to_f32(s[j]), tag);
    float a2 = round_to(x2 * to_f32(c[half + j]), tag);
    float b2 = round_to(x1 * to_f32(s[half + j]), tag);
    asm("" : "+v"(a1), "+v"(b1), "+v"(a2), "+v"(b2));
    store(x + j, round_to(a1 - b1, tag));
    store(x + half + j, round_to(a2 + b2, tag));
  }
}

// Optional paged KV cache write fused into the same pass (vLLM's reshape_and_cache): after a
// token's key heads are rotated, its key row (hk heads of d, adjacent) and value row (v, row
// stride v_stride) are copied to row slots[t] of k_cache / v_cache ([num_slots, hk, d],
// contiguous), while the row is still in L1. Every slot is checked before anything is written.
template <class T>
struct CacheWrite {
  const T* v = nullptr;
  int64_t v_stride = 0;
  T* k_cache = nullptr;
  T* v_cache = nullptr;
  const int64_t* slots = nullptr;
  int64_t num_slots = 0;
};

template <class T>
int run(T* q, int64_t q_stride, int64_t hq, T* k, int64_t k_stride, int64_t hk, int64_t d,
        const T* cos, const T* sin, int64_t rows, int64_t threads,
        const CacheWrite<T>& cw = CacheWrite<T>{}) {
  if (rows < 0 || d <= 0 || d % 2 != 0 || hq < 0 || hk < 0) return 1;
  if (cw.slots != nullptr) {
    for (int64_t t = 0; t < rows; ++t) {
      if (cw.slots[t] < 0 || cw.slots[t] >= cw.num_slots) return 2;
    }
  }
  const int64_t row_bytes = hk * d * static_cast<int64_t>(sizeof(T));
  const int64_t use = rows >= 2 * kRowsPerThread ? threads : 1;
#pragma omp parallel for num_threads(use) schedule(static) if (use > 1)
  for (int64_t t = 0; t < rows; ++t) {
    const T* c = cos + t * d;
    const T* s = sin + t * d;
    for (int64_t h = 0; h < hq; ++h) rotate_head(q + t * q_stride + h * d, c, s, d);
    for (int64_t h = 0; h < hk; ++h) rotate_head(k + t * k_stride + h * d, c, s, d);
    if (cw.slots != nullptr) {
      const int64_t slot = cw.slots[t];
      std::memcpy(cw.k_cache + slot * hk * d, k + t * k_stride, row_bytes);
      std::memcpy(cw.v_cache + slot * hk * d, cw.v + t * cw.v_stride, row_bytes);
    }
  }
  return 0;
}

}  // namespace

extern "C" int batchgen_rotary_f32(float* q, int64_t q_stride, int64_t hq, float* k,
                                   int64_t k_stride, int64_t hk, int64_t d, const float* cos,
                                   const float* sin, int64_t rows, int64_t threads) {
  return run(q, q_stride, hq, k, k_stride, hk, d, cos, sin, rows, threads);
}

// q, k, cos, sin: bf16 bits (uint16).
extern "C" int batchgen_rotary_bf16(uint16_t* q, int64_t q_stride, int64_t hq, uint16_t* k,
                                    int64_t k_stride, int64_t hk, int64_t d, const uint16_t* cos,
                                    const uint16_t* sin, int64_t rows, int64_t threads) {
  return run(q, q_stride, hq, k, k_stride, hk, d, cos, sin, rows, threads);
}

// rotary as above, then k (rotated) and v rows written to the paged cache at slots[t]
// (CacheWrite). Returns 2 (nothing written) when a slot is outside [0, num_slots).
extern "C" int batchgen_rotary_cache_f32(float* q, int64_t q_stride, int64_t hq, float* k,
                                         int64_t k_stride, int64_t hk, int64_t d,
                                         const float* cos, const float* sin, int64_t rows,
                                         int64_t threads, const float* v, int64_t v_stride,
                                         float* k_cache, float* v_cache, const int64_t* slots,
                                         int64_t num_slots) {
  const CacheWrite<float> cw{v, v_stride, k_cache, v_cache, slots, num_slots};
  return run(q, q_stride, hq, k, k_stride, hk, d, cos, sin, rows, threads, cw);
}

extern "C" int batchgen_rotary_cache_bf16(uint16_t* q, int64_t q_stride, int64_t hq,
                                          uint16_t* k, int64_t k_stride, int64_t hk, int64_t d,
                                          const uint16_t* cos, const uint16_t* sin,
                                          int64_t rows, int64_t threads, const uint16_t* v,
                                          int64_t v_stride, uint16_t* k_cache,
                                          uint16_t* v_cache, const int64_t* slots,
                                          int64_t num_slots) {
  const CacheWrite<uint16_t> cw{v, v_stride, k_cache, v_cache, slots, num_slots};
  return run(q, q_stride, hq, k, k_stride, hk, d, cos, sin, rows, threads, cw);
}
