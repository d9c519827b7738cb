// The element types of a KV cache narrower than q, for the mixed entry of paged decode
// attention (paged_decode_attention_mixed.h includes this; paged_decode_attention.cpp includes
// that after bf16_t and to_f32): the cache dtype codes (KvDtype), the exact value of an fp8
// byte (`fp8_value`, by table: `fp8_table`), the per-dtype storage types KvBf16, KvE5m2, KvE4m3
// (scalar value, AVX-512F `load16`), and one cache row decoded into float32 (`decode_row`: by
// table or vector; `convert_row`: AVX-512F, in units of kUnit).
//
// Conversions, 16 values a zmm (exact):
//   bf16:   zero-extended to 32 bits, shifted left 16.
//   e5m2:   the byte is the high byte of an IEEE half: zero-extended to 16 bits, shifted left 8,
//           `vcvtph2ps`.
//   e4m3fn: half bits ((b & 0x80) << 8) | ((b & 0x7F) << 7), i.e. b sign-extended to 16 bits,
//           shifted left 7, bit 14 (a copy of the sign) cleared; `vcvtph2ps` gives the value
//           x 2^-8 for normals and subnormals alike (half's exponent bias is 8 more than
//           e4m3's), and the 2^8 is folded into the scales (kUnit). NaN (0x7F, 0xFF) is never
//           stored: the writer clamps to the finite range.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

enum KvDtype : int64_t { kKvBf16 = 0, kKvE4m3 = 1, kKvE5m2 = 2 };

// The value of an fp8 byte (e4m3fn: bias 7, 3 mantissa bits, no infinities; e5m2: bias 15, 2
// mantissa bits), exact; NaN encodings (never stored) decode as 0.
inline float fp8_value(uint32_t b, bool e4m3) {
  const int mbits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
  const uint32_t e = (b & 0x7F) >> mbits, m = b & ((1u << mbits) - 1);
  if ((e4m3 && (b & 0x7F) == 0x7F) || (!e4m3 && e == 31)) return 0.0f;
  // e == 0: subnormal, m x 2^(1 - bias - mbits); else (2^mbits + m) x 2^(e - bias - mbits).
  const float mag = e == 0 ? std::ldexp(float(m), 1 - bias - mbits)
                           : std::ldexp(float((1u << mbits) + m), int(e) - bias - mbits);
  return (b & 0x80) ? -mag : mag;
}

// Every byte's value, built once.
template <bool E4m3>
inline const float* fp8_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (uint32_t b = 0; b < 256; ++b) t[b] = fp8_value(b, E4m3);
    return t;
  }();
  return table.data();
}

// Cache element types: storage T, the exact scalar value, and (AVX-512F) 16 values as float32
// (their values / kUnit: the scales are multiplied by kUnit).
struct KvBf16 {
  using T = bf16_t;
  static constexpr float kUnit = 1.0f;
  static float value(T x) { return to_f32(x); }
#if defined(__AVX512F__)
  static __m512 load16(const T* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
#endif
};

struct KvE5m2 {
  using T = uint8_t;
  static constexpr float kUnit = 1.0f;
  static float value(T x) { return fp8_table<false>()[x]; }
#if defined(__AVX512F__)
  static __m512 load16(const T* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8));
  }
#endif
};

struct KvE4m3 {
  using T = uint8_t;
  static constexpr float kUnit = 256.0f;  // load16 gives the value / 2^8
  static float value(T x) { return fp8_table<true>()[x]; }
#if defined(__AVX512F__)
  static __m512 load16(const T* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    // Sign-extended and shifted left 7: bits 15 and 14 hold the sign, 13-7 the rest.
    const __m256i t = _mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7);
    return _mm512_cvtph_ps(_mm256_and_si256(t, _mm256_set1_epi16(int16_t(0xBFFF))));
  }
#endif
};

// One cache row of `row` values decoded exactly into float32: by table (scalar), or where
// `vec` (AVX-512F build, row a multiple of 16) by KV::load16 and rescaled by kUnit (a power of
// two: the same floats).
template <class KV>
inline void decode_row(const typename KV::T* src, float* dst, int64_t row, bool vec) {
#if defined(__AVX512F__)
  if (vec) {
    const __m512 unit = _mm512_set1_ps(KV::kUnit);
    for (int64_t c = 0; c < row; c += 16)
      _mm512_storeu_ps(dst + c, _mm512_mul_ps(KV::load16(src + c), unit));
    return;
  }
#endif
  (void)vec;
  for (int64_t i = 0; i < row; ++i) dst[i] = KV::value(src[i]);
}

#if defined(__AVX512F__)
// One cache row of `row` values (a multiple of 16) as float32 (values / KV::kUnit) into dst.
template <class KV>
inline void convert_row(const typename KV::T* src, float* dst, int64_t row) {
  for (int64_t c = 0; c < row; c += 16) _mm512_storeu_ps(dst + c, KV::load16(src + c));
}
#endif

}  // namespace
