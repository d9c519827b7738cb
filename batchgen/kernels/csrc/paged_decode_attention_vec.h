// The AVX-512F and AVX2 vector paths of the paged decode attention kernel (float32 and bf16
// widened to float32; paged_decode_attention.cpp includes this after Args, Scratch,
// begin_seq, end_seq and softmax_heads).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

#if defined(__AVX2__) && defined(__FMA__)
// The vector path. The generic score loop ends every dot product in a horizontal sum; here 8
// positions x one query head run in 8 register accumulators, reduced together by one
// transpose-add (`hsum8`; 16-wide accumulators are first folded to 8 lanes). Row pointers are
// computed once per sequence (no division per head and position). Values are summed row by
// row, prefetching `kValuePrefetch` rows ahead. In cache (one sequence, 256 positions) the AVX2
// float32 path took 77-87 ns per position against 126 for the generic loops; from memory,
// where the kernel is bandwidth-bound, the gain is about 7% (see paged_attention.py).
constexpr int64_t kValuePrefetch = 16;

// r[i] = sum of the 8 lanes of v[i].
inline __m256 hsum8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]);
  const __m256 t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]);
  const __m256 t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1);  // [v0..v3 low-half sums | v0..v3 high-half sums]
  const __m256 u1 = _mm256_hadd_ps(t2, t3);  // the same for v4..v7
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

struct Avx2 {  // 8 floats a vector
  using V = __m256;
  static constexpr int64_t kWidth = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const bf16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static __m256 fold8(V x) { return x; }
};

#if defined(__AVX512F__)
struct Avx512 {  // 16 floats a vector
  using V = __m512;
  static constexpr int64_t kWidth = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const bf16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static __m256 fold8(V x) {  // lanes i and i + 8 added
    const __m256 lo = _mm512_castps512_ps256(x);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
    return _mm256_add_ps(lo, hi);
  }
};
#endif

template <class Vec, class T>
void run_seq_vector(const Args<T>& a, int64_t b, Scratch& s, std::vector<const T*>& k_rows,
                    std::vector<const T*>& v_rows) {
  using V = typename Vec::V;
  constexpr int64_t W = Vec::kWidth;
  const int64_t g_size = a.hq / a.hkv, row = a.hkv * a.d, d = a.d;
  constexpr int64_t kLine = 64 / sizeof(T);  // elements per cache line
  int64_t start, n;
  if (!begin_seq(a, b, s, start, n)) return;
  const int64_t* table = a.block_tables + b * a.max_blocks;
  const int64_t n8 = (n + 7) / 8 * 8;
  k_rows.resize(n8);
  v_rows.resize(n8);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t p = start + j;
    const int64_t slot = table[p / a.block_size] * a.block_size + p % a.block_size;
    k_rows[j] = a.k_cache + slot * row;
    v_rows[j] = a.v_cache + slot * row;
  }
  for (int64_t j = n; j < n8; ++j) k_rows[j] = v_rows[j] = k_rows[0];  // read, never used
  s.scores.resize(a.hq * n8);
  // Scores: s[hq][j] = scale * <q_hq, k_j[hq / G]>, 8 positions at a time.
  const __m256 scale = _mm256_set1_ps(a.scale);
  for (int64_t j0 = 0; j0 < n8; j0 += 8) {
    for (int64_t j = j0 + 8; j < std::min(j0 + 16, n); ++j)
      for (int64_t off = 0; off < row; off += kLine) __builtin_prefetch(k_rows[j] + off, 0, 0);
    for (int64_t hq = 0; hq < a.hq; ++hq) {
      const float* qh = s.qf.data() + hq * d;
      const int64_t col = (hq / g_size) * d;
      V acc[8];
      for (int p = 0; p < 8; ++p) acc[p] = Vec::zero();
      for (int64_t c = 0; c < d; c += W) {
        const V qv = Vec::load(qh + c);
        for (int p = 0; p < 8; ++p)
          acc[p] = Vec::fmadd(qv, Vec::load(k_rows[j0 + p] + col + c), acc[p]);
      }
      __m256 folded[8];
      for (int p = 0; p < 8; ++p) folded[p] = Vec::fold8(acc[p]);
      _mm256_storeu_ps(s.scores.data() + hq * n8 + j0, _mm256_mul_ps(hsum8(folded), scale));
    }
  }
  softmax_heads<T>(s.scores.data(), n8, n, a.hq, s.inv_sum.data());  // the padding past n left out
  // Weighted sum of values, position by position (rows in order, which the hardware
  // prefetcher follows within a block), prefetching the row a block ahead.
  float* acc = s.acc.data();
  for (int64_t j = 0; j < n; ++j) {
    if (j + kValuePrefetch < n)
      for (int64_t off = 0; off < row; off += kLine)
        __builtin_prefetch(v_rows[j + kValuePrefetch] + off, 0, 0);
    for (int64_t hq = 0; hq < a.hq; ++hq) {
      const V w = Vec::set1(s.scores[hq * n8 + j]);
      const T* vh = v_rows[j] + (hq / g_size) * d;
      float* o = acc + hq * d;
      for (int64_t c = 0; c < d; c += W)
        Vec::store(o + c, Vec::fmadd(w, Vec::load(vh + c), Vec::load(o + c)));
    }
  }
  end_seq(a, b, s);
}
#endif

}  // namespace
