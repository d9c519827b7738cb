// Shared by the attention kernels (paged_decode_attention_bf16.h, paged_decode_attention_f32.h,
// prefill_attention.cpp): the AVX-512 target attribute, the run-time check for avx512f +
// avx512_bf16, and a vector exp (AVX-512F).
#pragma once

#include "fused_moe_common.h"

namespace {

#if BATCHGEN_HAVE_BF16
#define BATCHGEN_ATTN_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16")))

// True where the CPU runs avx512f and avx512_bf16 (checked once; the library may be built on a
// CPU without them).
inline bool avx512_bf16_usable() {
  static const bool usable = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
  }();
  return usable;
}

#endif

#if BATCHGEN_HAVE_BF16 || defined(__AVX512F__)
// e^x per lane for x <= 88.37 (the softmax calls it on x <= 0), float32. Cephes' expf
// (S. Moshier, Cephes Math Library, expf.c): n = round(x log2 e); r = x - n ln2 in two parts
// (C1 = 0.693359375 exact, C2 = -2.12194440e-4) so r is exact-ish on [-ln2/2, ln2/2];
// e^r = 1 + r + r^2 P(r), P of degree 5 (Cephes' minimax coefficients); times 2^n by
// `vscalefps` (exact, and it underflows to subnormals and 0 correctly). Cephes states a peak
// relative error of 1.7e-7 (rms 2.8e-8) over [-87.3, 88.7] in IEEE single; inputs below -104
// are clamped there (e^-104 < 2^-149: the result is 0). NaN in, NaN out.
// AVX-512F only (the bf16 kernels and the float32 decode path call it).
__attribute__((target("avx512f"))) inline __m512 exp_ps(__m512 x) {
  // The clamps' operand order keeps a NaN: vmaxps / vminps return their second operand when
  // either is NaN (x first, a NaN score became -104 and its weight 0: the key was dropped).
  x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);
  x = _mm512_min_ps(_mm512_set1_ps(88.3762626647949f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}

#endif

}  // namespace
