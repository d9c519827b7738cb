// The KV cache's element types of the prefill attention kernel (vLLM's kv_cache_dtype: the cache
// may be narrower than q) and their conversions, scalar (the generic path) and 16 lanes at a
// time (the AVX-512 path, which stages each block's K/V rows in q's compute type).
//
// Cache elements: float32, bf16 (uint16 bits), fp8 e4m3fn and e5m2 (one byte, tagged types so
// overloads tell them apart). Every value of these formats is exact in float32 and in bf16
// (the writer clamps to the finite range; a NaN it was given stays NaN, read as NaN), so reading
// them is exact:
//   bf16 -> f32: the bits shifted into the high half;
//   e5m2 -> f32: the byte is the high byte of an IEEE half (`vcvtph2ps`);
//   e4m3fn -> f32: half bits ((b & 0x80) << 8) | ((b & 0x7F) << 7) hold the value times 2^-8
//           (exponent bias 15 against 7; e4m3's subnormals land on the half's subnormals), so
//           the vector converter returns x / kVecUnit<C> with kVecUnit = 2^8, folded by the
//           caller into the score scale (K) and the output scale (V): exact, powers of two;
//           e4m3fn's NaN (0x7F, 0xFF) lands on +-1.875 (480 / 2^8, no e4m3fn value) and is
//           replaced by NaN.
// f32 -> bf16 of a converted value truncates (exact: it fits bf16, 3 or fewer mantissa bits
// and exponents within bf16's range, the 2^-8 included).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "attention_exp.h"  // BATCHGEN_ATTN_BF16_TARGET

namespace {

struct fp8_e4m3 {
  uint8_t bits;
};
struct fp8_e5m2 {
  uint8_t bits;
};

// Cache dtype codes, as `batchgen.kernels.prefill_attention` passes them.
enum KvCode : int64_t { kF32 = 0, kBf16 = 1, kE4m3 = 2, kE5m2 = 3 };

// The 256 values of an fp8 format as float32 (exact), built once.
struct Fp8Table {
  float v[256];
  explicit Fp8Table(bool e4m3) : v() {
    for (int b = 0; b < 256; ++b) {
      const int sign = b >> 7;
      const int exp_bits = e4m3 ? 4 : 5, man_bits = 7 - exp_bits;
      const int bias = e4m3 ? 7 : 15;
      const int e = (b & 0x7F) >> man_bits, m = b & ((1 << man_bits) - 1);
      // subnormal: m 2^(1 - bias - man_bits); normal: (2^man_bits + m) 2^(e - bias - man_bits)
      float x = e == 0 ? float(m) : float((1 << man_bits) + m);
      int p = (e == 0 ? 1 : e) - bias - man_bits;
      for (; p > 0; --p) x *= 2.0f;
      for (; p < 0; ++p) x *= 0.5f;
      if (e4m3 && (b & 0x7F) == 0x7F) x = __builtin_nanf("");  // e4m3fn has no inf
      if (!e4m3 && e == 31) x = m ? __builtin_nanf("") : __builtin_inff();
      v[b] = sign ? -x : x;
    }
  }
};
inline const Fp8Table& e4m3_table() {
  static const Fp8Table t(true);
  return t;
}
inline const Fp8Table& e5m2_table() {
  static const Fp8Table t(false);
  return t;
}
inline float to_f32(fp8_e4m3 x) { return e4m3_table().v[x.bits]; }
inline float to_f32(fp8_e5m2 x) { return e5m2_table().v[x.bits]; }

// What the vector converter's values are multiplied by to give the stored values.
template <class C>
constexpr float kVecUnit = std::is_same_v<C, fp8_e4m3> ? 256.0f : 1.0f;

#if BATCHGEN_HAVE_BF16
#define BATCHGEN_PREFILL_KV_TARGET __attribute__((target("avx512f,avx512bw,avx512dq")))

// 16 cache elements as float32, divided by kVecUnit<C>.
BATCHGEN_PREFILL_KV_TARGET inline __m512 load16_kv(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
BATCHGEN_PREFILL_KV_TARGET inline __m512 load16_kv(const fp8_e5m2* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8));
}
BATCHGEN_PREFILL_KV_TARGET inline __m512 load16_kv(const fp8_e4m3* p) {
  // Sign-extended to 16 bits and shifted left 7: bits 13..7 the magnitude, 15 and 14 the sign;
  // bit 14 cleared: ((b & 0x80) << 8) | ((b & 0x7F) << 7).
  const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(int16_t(0xBFFF)));
  const __m512 x = _mm512_cvtph_ps(h);
  const __mmask16 nan = _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(1.875f), _CMP_EQ_OQ);
  return _mm512_mask_mov_ps(x, nan, _mm512_set1_ps(__builtin_nanf("")));
}

// Row r (d elements, d % 16 == 0) of the cache converted into dst, float32, divided by
// kVecUnit<C>.
template <class C>
BATCHGEN_PREFILL_KV_TARGET inline void stage_row(const C* r, int64_t d, float* dst) {
  for (int64_t c = 0; c < d; c += 16) _mm512_storeu_ps(dst + c, load16_kv(r + c));
}

// The bf16 twin (d % 32 == 0): `vcvtne2ps2bf16` rounds nothing, the values fit bf16.
template <class C>
BATCHGEN_ATTN_BF16_TARGET inline void stage_row(const C* r, int64_t d, uint16_t* dst) {
  for (int64_t c = 0; c < d; c += 32) {
    const __m512bh x = _mm512_cvtne2ps_pbh(load16_kv(r + c + 16), load16_kv(r + c));
    _mm512_storeu_si512(dst + c, (__m512i)x);
  }
}

// Rows r0 and r1 (d % 16 == 0) as bf16 key pairs [D][2] (word 2c: r0[c], 2c + 1: r1[c]), the
// layout `pack_v_pairs` writes, divided by kVecUnit<C>: per dimension the high half of r1's
// float32 bits and the high half of r0's, exact (the values fit bf16).
template <class C>
BATCHGEN_PREFILL_KV_TARGET inline void stage_pair(const C* r0, const C* r1, int64_t d,
                                                  uint16_t* dst) {
  const __m512i hi = _mm512_set1_epi32(int(0xFFFF0000u));
  for (int64_t c = 0; c < d; c += 16) {
    const __m512i a = _mm512_castps_si512(load16_kv(r0 + c));
    const __m512i b = r1 ? _mm512_castps_si512(load16_kv(r1 + c)) : _mm512_setzero_si512();
    _mm512_storeu_si512(dst + 2 * c, _mm512_or_si512(_mm512_and_si512(b, hi),
                                                     _mm512_srli_epi32(a, 16)));
  }
}
#endif

}  // namespace
