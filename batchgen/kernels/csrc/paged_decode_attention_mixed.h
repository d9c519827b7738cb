// Paged decode attention over a KV cache stored in a narrower dtype than q (vLLM's
// `kv_cache_dtype`): q and out float32 with a bfloat16, float8_e4m3fn or float8_e5m2 cache, or
// q and out bfloat16 with an fp8 cache. paged_decode_attention.cpp includes this after Args,
// Scratch, begin_seq, softmax_heads and the float32 AVX-512F path (softmax_f32_avx512).
//
// Semantics: a cached key is worth stored * k_scale, a value stored * v_scale (the stored value
// is exact in float32). Both scales are folded into scalars (k_scale into the score scale,
// v_scale into the output's 1 / sum), so the loops see the stored values only. Scores, softmax
// and the weighted sum run in float32; for bf16 q the unnormalised softmax weights are rounded
// to bf16 before the weighted sum and the output is rounded to bf16 (round to nearest even),
// as the bf16 kernel (and torch's CPU SDPA in bf16) does.
//
// Paths: AVX-512F where D is 64 or 128 (`run_seq_mixed_avx512`), any number of query heads;
// else generic loops (`run_seq_mixed_generic`: each row decoded once into float32, by
// AVX-512F where the build has it and isa allows, else by table; the same floats either way),
// also under a forced isa of `avx2` or `generic` (decoding by table). The AVX-512F path keeps
// the float32 path's structure (paged_decode_attention_f32.h): two query heads per zmm for the
// scores (8 positions a tile), a 16-lane softmax, each query head's P @ V accumulators in
// registers. The K rows of a score tile are converted to float32 once into an L1 buffer that
// the score loop reads (its broadcast loads are free in the load unit; converting there would
// repeat per head pair); P @ V converts each value chunk in registers once per pass for the
// pass's heads of one KV head (a buffer's stores and reloads took 10% more time with the cache
// in L2).
// The cache's element types and their exact conversions to float32: paged_decode_attention_kv.h.
// Prefetch: whole rows (every KV head, per 64-byte line of the narrower rows) kF32PrefetchRows
// positions ahead into L2, one row per row converted: K during the scores (V's first rows
// during the last tiles), V during P @ V.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "paged_decode_attention_kv.h"  // KvDtype, KvBf16, KvE5m2, KvE4m3, decode_row

namespace {

template <class Q, class KV>
struct MixedArgs {
  Args<Q> a;  // q, out and the metadata; a.k_cache and a.v_cache unused (null)
  const typename KV::T* k_cache;
  const typename KV::T* v_cache;
  double k_scale, v_scale;
};

// out[hq] = acc[hq] x inv_sum[hq] x v_factor, rounded to Q.
template <class Q, class KV>
void end_seq_mixed(const MixedArgs<Q, KV>& m, int64_t b, const Scratch& s, double v_factor) {
  const Args<Q>& a = m.a;
  Q* out = a.out + b * a.hq * a.d;
  for (int64_t hq = 0; hq < a.hq; ++hq) {
    const float f = float(double(s.inv_sum[hq]) * v_factor);
    for (int64_t i = 0; i < a.d; ++i) store(out + hq * a.d + i, s.acc[hq * a.d + i] * f);
  }
}

// Each cache row is decoded once into `rowf` (`decode_row`; `vec`: by vector where it can),
// then float32 loops (vectorised by the compiler) run.
template <class Q, class KV>
void run_seq_mixed_generic(const MixedArgs<Q, KV>& m, int64_t b, Scratch& s,
                           std::vector<float>& rowf, bool vec) {
  const Args<Q>& a = m.a;
  const int64_t g_size = a.hq / a.hkv, row = a.hkv * a.d;
  int64_t start, n;
  if (!begin_seq(a, b, s, start, n)) return;
  const int64_t len = a.kv_lens[b];
  const int64_t* table = a.block_tables + b * a.max_blocks;
  const float scale = float(double(a.scale) * m.k_scale);
  s.scores.resize(a.hq * n);
  rowf.resize(row);
  vec = vec && row % 16 == 0;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t p = start + j;
    const auto* k = m.k_cache + (table[p / a.block_size] * a.block_size + p % a.block_size) * row;
    prefetch_row(m.k_cache, table, p, len, a.block_size, row);
    decode_row<KV>(k, rowf.data(), row, vec);
    for (int64_t hq = 0; hq < a.hq; ++hq) {
      const float* qh = s.qf.data() + hq * a.d;
      const float* kh = rowf.data() + (hq / g_size) * a.d;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < a.d; ++i) dot += qh[i] * kh[i];
      s.scores[hq * n + j] = dot * scale;
    }
  }
  softmax_heads<Q>(s.scores.data(), n, n, a.hq, s.inv_sum.data());
  for (int64_t j = 0; j < n; ++j) {
    const int64_t p = start + j;
    const auto* v = m.v_cache + (table[p / a.block_size] * a.block_size + p % a.block_size) * row;
    prefetch_row(m.v_cache, table, p, len, a.block_size, row);
    decode_row<KV>(v, rowf.data(), row, vec);
    add_value_row(s.acc.data(), s.scores.data(), n, j, rowf.data(), a.hq, g_size, a.d);
  }
  end_seq_mixed(m, b, s, m.v_scale);
}

#if defined(__AVX512F__)
// Whether the AVX-512F mixed path runs for `isa` (auto or forced) and head size d.
inline bool mixed_avx512_applies(int64_t isa, int64_t d) {
  return (isa == kAuto || isa >= kAvx512) && (d == 64 || d == 128);
}

// The `bytes` bytes at p into L2, a prefetch per 64-byte line.
inline void prefetch_bytes_l2(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T1);
}


// Per-thread buffers of the mixed AVX-512F path: row pointers [n rounded up to 8] and a score
// tile's K rows as float32 [8, row].
template <class KV>
struct MixedRows {
  std::vector<const typename KV::T*> k, v;
  std::vector<float> buf;
};

// The scores of the head pair (ha, hb) over the 8 converted rows `kt` of a tile (row floats
// apart): lanes 0-7 run head ha's FMA chains against its KV head's chunk, lanes 8-15 head hb's
// (one broadcast load where both heads read one KV head). Returns the pair's 16 scores
// [ha(t0-7) | hb(t0-7)] times `scale`.
template <int64_t D, bool kSameKv>
inline __m512 pair_scores(const float* qp, const float* kt, int64_t row, int64_t col_a,
                          int64_t col_b, __m512 scale) {
  constexpr int64_t C8 = D / 8;
  __m512 acc[8];
  for (int t = 0; t < 8; ++t) acc[t] = _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int64_t c = 0; c < C8; ++c) {
    const __m512 qv = _mm512_loadu_ps(qp + c * 16);
    for (int t = 0; t < 8; ++t) {
      const float* k = kt + t * row + 8 * c;
      __m512 kv;
      if constexpr (kSameKv) {
        kv = _mm512_broadcast_f32x8(_mm256_loadu_ps(k + col_a));
      } else {
        const __m512d lo = _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(k + col_a)));
        kv = _mm512_castpd_ps(
            _mm512_insertf64x4(lo, _mm256_castps_pd(_mm256_loadu_ps(k + col_b)), 1));
      }
      acc[t] = _mm512_fmadd_ps(qv, kv, acc[t]);
    }
  }
  const __m512 u0 = hadd16(hadd16(acc[0], acc[1]), hadd16(acc[2], acc[3]));
  const __m512 u1 = hadd16(hadd16(acc[4], acc[5]), hadd16(acc[6], acc[7]));
  const __m512 sum = _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88),
                                   _mm512_shuffle_f32x4(u0, u1, 0xDD));
  const __m512 r = _mm512_mul_ps(sum, scale);
  return _mm512_shuffle_f32x4(r, r, 0xD8);
}

template <int64_t D, class Q, class KV>
void run_seq_mixed_avx512(const MixedArgs<Q, KV>& m, int64_t b, Scratch& s, MixedRows<KV>& rows) {
  constexpr int64_t C8 = D / 8, C16 = D / 16;
  const Args<Q>& a = m.a;
  const int64_t g_size = a.hq / a.hkv, row = a.hkv * D;
  const int64_t row_bytes = row * int64_t(sizeof(typename KV::T));
  int64_t start, n;
  if (!begin_seq(a, b, s, start, n)) return;
  const int64_t* table = a.block_tables + b * a.max_blocks;
  const int64_t n8 = (n + 7) / 8 * 8;
  rows.k.resize(n8);
  rows.v.resize(n8);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t p = start + j;
    const int64_t slot = table[p / a.block_size] * a.block_size + p % a.block_size;
    rows.k[j] = m.k_cache + slot * row;
    rows.v[j] = m.v_cache + slot * row;
  }
  for (int64_t j = n; j < n8; ++j) rows.k[j] = rows.v[j] = rows.k[0];  // read, never used
  rows.buf.resize(8 * row);  // a score tile's K rows as float32
  float* buf = rows.buf.data();
  // Query head pairs interleaved per 8-float chunk; an odd last head is paired with itself.
  const int64_t pairs = (a.hq + 1) / 2;
  s.qpair.resize(pairs * C8 * 16);
  for (int64_t pr = 0; pr < pairs; ++pr)
    for (int64_t c = 0; c < C8; ++c)
      for (int64_t l = 0; l < 16; ++l) {
        const int64_t h = std::min(2 * pr + l / 8, a.hq - 1);
        s.qpair[(pr * C8 + c) * 16 + l] = s.qf[h * D + 8 * c + l % 8];
      }
  s.scores.resize(a.hq * n8);
  float* scores = s.scores.data();
  const __m512 scale = _mm512_set1_ps(float(double(a.scale) * m.k_scale * KV::kUnit));
  for (int64_t j = 0; j < std::min(kF32PrefetchRows, n); ++j)
    prefetch_bytes_l2(rows.k[j], row_bytes);
  for (int64_t j0 = 0; j0 < n8; j0 += 8) {
    for (int64_t t = 0; t < 8; ++t) {
      // The row kF32PrefetchRows ahead: K's, then V's first rows during the last tiles.
      const int64_t ahead = j0 + t + kF32PrefetchRows;
      if (ahead < n)
        prefetch_bytes_l2(rows.k[ahead], row_bytes);
      else if (ahead - n < std::min(kF32PrefetchRows, n) && j0 + t < n)
        prefetch_bytes_l2(rows.v[ahead - n], row_bytes);
      convert_row<KV>(rows.k[j0 + t], buf + t * row, row);
    }
    for (int64_t pr = 0; pr < pairs; ++pr) {
      const int64_t ha = 2 * pr, hb = std::min(ha + 1, a.hq - 1);
      const int64_t col_a = (ha / g_size) * D, col_b = (hb / g_size) * D;
      const float* qp = s.qpair.data() + pr * C8 * 16;
      const __m512 ab = col_a == col_b ? pair_scores<D, true>(qp, buf, row, col_a, col_b, scale)
                                       : pair_scores<D, false>(qp, buf, row, col_a, col_b, scale);
      _mm256_storeu_ps(scores + ha * n8 + j0, _mm512_castps512_ps256(ab));
      if (hb != ha)
        _mm256_storeu_ps(scores + hb * n8 + j0,
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(ab), 1)));
    }
  }
  softmax_f32_avx512(scores, n8, n, a.hq, s.inv_sum.data());  // the padding past n left out
  if constexpr (std::is_same_v<Q, bf16_t>)  // the weights P @ V sums rounded, as the bf16 kernel
    for (int64_t hq = 0; hq < a.hq; ++hq)  // (the padding past n rounded too, never read)
      for (int64_t j = 0; j < n; j += 16) {
        float* w = scores + hq * n8 + j;
        const __mmask16 lanes = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
        _mm512_mask_storeu_ps(w, lanes, bgrows::round16(_mm512_maskz_loadu_ps(lanes, w), bf16_t{}));
      }
  // P @ V: per chunk of 16 positions, its query heads in passes of up to 16 zmm; each value
  // row's chunks converted in registers once per pass for the pass's heads of one KV head.
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
      // Each head's KV head column; whether the head before it read another (then convert).
      int64_t col[kHeadsPerPass];
      bool fresh[kHeadsPerPass];
      for (int64_t h = 0; h < kHeadsPerPass; ++h) {
        col[h] = std::min(h0 + h, a.hq - 1) / g_size * D;
        fresh[h] = h == 0 || col[h] != col[h - 1];
      }
      for (int64_t j = j0; j < j1; ++j) {
        if (h0 == 0 && j + kF32PrefetchRows < n)  // one row a position, the first pass
          prefetch_bytes_l2(rows.v[j + kF32PrefetchRows], row_bytes);
        __m512 vc[C16];
#pragma GCC unroll 16
        for (int64_t h = 0; h < kHeadsPerPass; ++h) {
          if (h >= hs) break;
          if (fresh[h])
            for (int64_t c = 0; c < C16; ++c) vc[c] = KV::load16(rows.v[j] + col[h] + 16 * c);
          const __m512 w = _mm512_set1_ps(scores[(h0 + h) * n8 + j]);
          for (int64_t c = 0; c < C16; ++c) acc[h][c] = _mm512_fmadd_ps(w, vc[c], acc[h][c]);
        }
      }
#pragma GCC unroll 16
      for (int64_t h = 0; h < kHeadsPerPass; ++h)
        for (int64_t c = 0; c < C16; ++c)
          if (h < hs) _mm512_storeu_ps(acc_out + (h0 + h) * D + 16 * c, acc[h][c]);
    }
  }
  end_seq_mixed(m, b, s, m.v_scale * KV::kUnit);
}
#endif

template <class Q, class KV>
int run_mixed(const MixedArgs<Q, KV>& m, int64_t num_seqs, int64_t num_threads) {
  const Args<Q>& a = m.a;
  if (a.hkv <= 0 || a.hq % a.hkv != 0 || a.d <= 0 || a.block_size <= 0) return 1;
  num_threads = std::max<int64_t>(1, std::min<int64_t>(num_threads, num_seqs));
  const std::vector<int64_t> order = longest_first(a.kv_lens, num_seqs, num_threads);
#pragma omp parallel num_threads(num_threads)
  {
    Scratch s;
    std::vector<float> rowf;  // the generic loops' decoded row
#if defined(__AVX512F__)
    MixedRows<KV> rows;
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_seqs; ++i) {
      const int64_t b = order.empty() ? i : order[i];
#if defined(__AVX512F__)
      if (mixed_avx512_applies(a.isa, a.d)) {
        if (a.d == 64)
          run_seq_mixed_avx512<64>(m, b, s, rows);
        else
          run_seq_mixed_avx512<128>(m, b, s, rows);
        continue;
      }
#endif
      run_seq_mixed_generic(m, b, s, rowf, a.isa == kAuto || a.isa >= kAvx512);
    }
  }
  return 0;
}

// The mixed entry's dispatch on the cache dtype; 3 for an unknown one.
template <class Q>
int run_mixed_cache(const Args<Q>& a, const void* k_cache, const void* v_cache, int64_t kv_dtype,
                    double k_scale, double v_scale, int64_t num_seqs, int64_t num_threads) {
  auto go = [&](auto kv) {
    using KV = decltype(kv);
    using T = typename KV::T;
    const MixedArgs<Q, KV> m{a, static_cast<const T*>(k_cache), static_cast<const T*>(v_cache),
                             k_scale, v_scale};
    return run_mixed(m, num_seqs, num_threads);
  };
  if (kv_dtype == kKvE4m3) return go(KvE4m3{});
  if (kv_dtype == kKvE5m2) return go(KvE5m2{});
  if (kv_dtype == kKvBf16 && std::is_same_v<Q, float>) return go(KvBf16{});
  return 3;
}

}  // namespace
