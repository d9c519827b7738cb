// The AVX-512F path of the float32 paged decode attention kernel (paged_decode_attention.cpp
// includes this after Args, Scratch, begin_seq, end_seq and the AVX2 path).
//
// Per sequence, positions [start, len) as n rows (row pointers computed once), three phases:
//   scores  two query heads of one KV head per zmm: lanes 0-7 run an 8-lane FMA chain over
//           D / 8 chunks for head a, lanes 8-15 the same chain for head b, against one K chunk
//           broadcast to both halves (`vbroadcastf32x8`): half the FMAs of the AVX2 path for
//           the same chains. 8 positions a tile; the 8-lane sums by the AVX2 path's tree,
//           ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) (`hadd16` is `vhaddps` per 128
//           bits), for both heads at once: the scores are bit-identical to the AVX2 path's. The
//           K rows of a tile stay in L1 across the Hq / 2 head pairs.
//   softmax per query head, 16 lanes: max, `exp_ps` (Cephes, attention_exp.h), the sum of the
//           exponentials in 16 lanes reduced by `_mm512_reduce_add_ps`. An explicit order: the
//           AVX2 path's `softmax_heads` is whatever GCC's vectoriser makes of it where it is
//           inlined (libmvec's 8-lane expf for the body, glibc's scalar expf for the tail), so
//           its bits change with the code around it. Here the weights differ from the AVX2
//           path's by a few ulps (Cephes' expf: peak relative error 1.7e-7).
//   P @ V   per KV head, its G query heads x D float32 accumulators in registers (up to 16
//           zmm: more heads take further passes over a chunk's rows), one FMA chain per
//           element in position order, a chunk of 16 positions at a time so that a chunk's
//           value rows (both KV heads) stay in L1 across the KV heads.
// Prefetch: whole rows (every KV head) `kF32PrefetchRows` positions ahead into L2
// (`prefetcht1`), spread over the work (two rows per head pair of a score tile, one row per
// position of P @ V) rather than in bursts; the first V rows during the last score tiles. Rows
// of a sequence sit in blocks anywhere in the cache: the hardware prefetcher follows a block's
// rows but cannot guess the next block. perf (one thread, 256 sequences, 4 caches cycled):
// about 60% of the samples sit on the prefetches, i.e. the core waits on its cache misses.
// Measured against L1 prefetches (`prefetcht0`) of 8-row bursts: 0.86x the time; the
// distance (16-128 rows) made no difference.
// Applies where D is 64 or 128 and G = Hq / Hkv is even (head pairs share a KV head); else
// the AVX2 path runs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention_exp.h"  // exp_ps

namespace {

#if defined(__AVX512F__)
constexpr int64_t kF32PrefetchRows = 32;  // positions ahead (two blocks of 16)

// Per 128-bit lane: [a0 + a1, a2 + a3, b0 + b1, b2 + b3] (`vhaddps`'s pairs, 512 bits wide).
inline __m512 hadd16(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

// Rows j0 .. j1 - 1 of `rows` (row floats each) into L2.
inline void prefetch_f32_rows(const float* const* rows, int64_t j0, int64_t j1, int64_t row) {
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t off = 0; off < row; off += 16) _mm_prefetch(rows[j] + off, _MM_HINT_T1);
}

// Whether the AVX-512F float32 path applies to head size d and G query heads per KV head.
inline bool f32_avx512_applies(int64_t d, int64_t g) { return (d == 64 || d == 128) && g % 2 == 0; }

// Softmax of each query head's scores s[hq * stride + j], j < n, in place (unnormalised
// exponentials); inv_sum[hq] = 1 / their sum. stride >= n.
inline void softmax_f32_avx512(float* scores, int64_t stride, int64_t n, int64_t hq_count,
                               float* inv_sum) {
  const __mmask16 tail = __mmask16((1u << (n % 16)) - 1u);
  const int64_t body = n / 16 * 16;
  for (int64_t hq = 0; hq < hq_count; ++hq) {
    float* s = scores + hq * stride;
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < body; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
    if (tail) m = _mm512_mask_max_ps(m, tail, m, _mm512_maskz_loadu_ps(tail, s + body));
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < body; j += 16) {
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + j), mx));
      _mm512_storeu_ps(s + j, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (tail) {
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + body), mx));
      _mm512_mask_storeu_ps(s + body, tail, e);
      sum = _mm512_mask_add_ps(sum, tail, sum, e);
    }
    inv_sum[hq] = 1.0f / _mm512_reduce_add_ps(sum);
  }
}

template <int64_t D>
void run_seq_f32_avx512(const Args<float>& a, int64_t b, Scratch& s,
                        std::vector<const float*>& k_rows, std::vector<const float*>& v_rows) {
  constexpr int64_t C8 = D / 8, C16 = D / 16;
  const int64_t g_size = a.hq / a.hkv, row = a.hkv * D;
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
  // Query head pairs interleaved per 8-float chunk: qp[pair][c] = [q_2p[8c:8c+8], q_2p+1[...]].
  const int64_t pairs = a.hq / 2;
  s.qpair.resize(pairs * C8 * 16);
  for (int64_t pr = 0; pr < pairs; ++pr)
    for (int64_t c = 0; c < C8; ++c)
      for (int64_t l = 0; l < 16; ++l)
        s.qpair[(pr * C8 + c) * 16 + l] = s.qf[(2 * pr + l / 8) * D + 8 * c + l % 8];
  s.scores.resize(a.hq * n8);
  float* scores = s.scores.data();
  const __m512 scale = _mm512_set1_ps(a.scale);
  prefetch_f32_rows(k_rows.data(), 0, std::min(kF32PrefetchRows, n), row);
  for (int64_t j0 = 0; j0 < n8; j0 += 8) {
    // The 8 rows kF32PrefetchRows ahead: K's, then V's first rows during the last tiles.
    const int64_t ahead = j0 + kF32PrefetchRows;
    const bool k_ahead = ahead < n;
    const float* const* pf_rows = k_ahead ? k_rows.data() : v_rows.data();
    const int64_t pf0 = k_ahead ? ahead : ahead - n;
    const int64_t pf_end = k_ahead || pf0 < kF32PrefetchRows ? std::min(pf0 + 8, n) : 0;
    for (int64_t pr = 0; pr < pairs; ++pr) {
      prefetch_f32_rows(pf_rows, std::min(pf0 + pr * 8 / pairs, pf_end),
                        std::min(pf0 + (pr + 1) * 8 / pairs, pf_end), row);
      const float* qp = s.qpair.data() + pr * C8 * 16;
      const int64_t col = (2 * pr / g_size) * D;
      __m512 acc[8];
      for (int t = 0; t < 8; ++t) acc[t] = _mm512_setzero_ps();
#pragma GCC unroll 16
      for (int64_t c = 0; c < C8; ++c) {
        const __m512 qv = _mm512_loadu_ps(qp + c * 16);
        for (int t = 0; t < 8; ++t)
          acc[t] = _mm512_fmadd_ps(qv, _mm512_broadcast_f32x8(_mm256_loadu_ps(
                                       k_rows[j0 + t] + col + 8 * c)), acc[t]);
      }
      // 128-bit lanes: 0, 1 head a's lanes 0-3, 4-7; 2, 3 head b's.
      const __m512 u0 = hadd16(hadd16(acc[0], acc[1]), hadd16(acc[2], acc[3]));
      const __m512 u1 = hadd16(hadd16(acc[4], acc[5]), hadd16(acc[6], acc[7]));
      // [a(t0-3), b(t0-3), a(t4-7), b(t4-7)] = low quads + high quads
      const __m512 sum = _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88),
                                       _mm512_shuffle_f32x4(u0, u1, 0xDD));
      const __m512 r = _mm512_mul_ps(sum, scale);
      const __m512 ab = _mm512_shuffle_f32x4(r, r, 0xD8);  // [a(t0-7) | b(t0-7)]
      _mm256_storeu_ps(scores + 2 * pr * n8 + j0, _mm512_castps512_ps256(ab));
      _mm256_storeu_ps(scores + (2 * pr + 1) * n8 + j0,
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(ab), 1)));
    }
  }
  softmax_f32_avx512(scores, n8, n, a.hq, s.inv_sum.data());  // the padding past n left out
  // P @ V: per chunk of 16 positions, per KV head, its query heads in passes of up to 16 zmm.
  constexpr int64_t kHeadsPerPass = std::max<int64_t>(1, 16 / C16);
  float* acc_out = s.acc.data();  // [Hq, D], zero from begin_seq
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t j1 = std::min(j0 + 16, n);
    for (int64_t h0 = 0; h0 < a.hq; h0 += kHeadsPerPass) {
      const int64_t hs = std::min(kHeadsPerPass, a.hq - h0);
      __m512 acc[kHeadsPerPass][C16];
#pragma GCC unroll 16
      for (int64_t h = 0; h < kHeadsPerPass; ++h)
        for (int64_t c = 0; c < C16; ++c)
          acc[h][c] = h < hs ? _mm512_loadu_ps(acc_out + (h0 + h) * D + 16 * c)
                             : _mm512_setzero_ps();
      // A pass's heads span KV heads where G < kHeadsPerPass: each head reads its own.
      for (int64_t j = j0; j < j1; ++j) {
        if (h0 == 0 && j + kF32PrefetchRows < n)  // one row a position, the first pass
          prefetch_f32_rows(v_rows.data(), j + kF32PrefetchRows, j + kF32PrefetchRows + 1, row);
#pragma GCC unroll 16
        for (int64_t h = 0; h < kHeadsPerPass; ++h) {
          if (h >= hs) break;
          const float* vh = v_rows[j] + ((h0 + h) / g_size) * D;
          const __m512 w = _mm512_set1_ps(scores[(h0 + h) * n8 + j]);
          for (int64_t c = 0; c < C16; ++c)
            acc[h][c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vh + 16 * c), acc[h][c]);
        }
      }
#pragma GCC unroll 16
      for (int64_t h = 0; h < kHeadsPerPass; ++h)
        for (int64_t c = 0; c < C16; ++c)
          if (h < hs) _mm512_storeu_ps(acc_out + (h0 + h) * D + 16 * c, acc[h][c]);
    }
  }
  end_seq(a, b, s);
}
#endif

}  // namespace
