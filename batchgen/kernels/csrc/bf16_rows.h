// Row helpers shared by the small row kernels (rms_norm.cpp, rotary_embedding.cpp): float32
// and bf16 (as uint16 bits) values read as float32, rounded to the storage type with round to
// nearest even, and stored; scalar and 16-lane AVX-512 versions that round identically.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace bgrows {

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

}  // namespace bgrows
