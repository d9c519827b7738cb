// The per-block steps of the AVX-512 path of the prefill attention kernel (its task loop,
// `run_task_vec`, is in prefill_attention_vec.h, which includes this; prefill_attention.cpp
// includes that after Args, Task, Scratch and the generic path): packing Q^T per tile
// (`pack_q_vec`), one head's scores S^T (`scores_f32`, `scores_bf16`), its online softmax step
// (`softmax_block`, `rescale_o`), P V (`pv_f32`, `pv_bf16`, `pv_head`; bf16 with P^T and the
// block's V rows as key pairs: `pairs_bf16`, `pack_v_pairs`), and the output rows
// (`write_out_f32`, `write_out_bf16`). Layouts and numerics: see prefill_attention_vec.h.
#pragma once

namespace {

#if BATCHGEN_HAVE_BF16
#define BATCHGEN_PREFILL_F32_TARGET __attribute__((target("avx512f,avx512bw,avx512dq")))

// Q^T of a tile's heads into tile slot ti of the task: float32 [G][D][16], bf16 [G][D / 2][16]
// 32-bit pairs of dimensions (lanes past nq stay zero: the caller zeroes the buffers).
template <class T, class C>
inline void pack_q_vec(const Args<T, C>& a, const Task& t, int64_t ti, Scratch& s) {
  const int64_t g = a.hq / a.hkv, d = a.d, tok0 = a.spans[4 * t.span] + t.i0;
  if constexpr (std::is_same_v<T, float>) {
    float* qt = s.qt.data() + ti * g * d * kTQ;
    for (int64_t h = 0; h < g; ++h)
      for (int64_t q = 0; q < t.nq; ++q) {
        const float* qr = a.q + (tok0 + q) * a.q_stride + (t.kv * g + h) * d;
        for (int64_t dd = 0; dd < d; ++dd) qt[(h * d + dd) * kTQ + q] = qr[dd];
      }
  } else {
    auto* qv = reinterpret_cast<uint32_t*>(s.qv.data() + ti * g * d * kTQ);
    for (int64_t h = 0; h < g; ++h)
      for (int64_t q = 0; q < t.nq; ++q) {
        const bf16_t* qr = a.q + (tok0 + q) * a.q_stride + (t.kv * g + h) * d;
        for (int64_t i = 0; i < d / 2; ++i)
          std::memcpy(&qv[(h * d / 2 + i) * kTQ + q], qr + 2 * i, 4);
      }
  }
}

// S^T[k][q] = <K_k, Q_q> (unscaled) for keys k < live of the block (rows[k] their cache rows;
// rows past the block's last key repeat a valid row: masked later), one head's Q^T.
BATCHGEN_PREFILL_F32_TARGET inline void scores_f32(const float* const* rows, int64_t live,
                                                   int64_t d, const float* qt, float* st) {
  for (int64_t k0 = 0; k0 < live; k0 += 8) {
    __m512 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t dd = 0; dd < d; ++dd) {
      const __m512 qd = _mm512_load_ps(qt + dd * kTQ);
      for (int j = 0; j < 8; ++j)
        acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(rows[k0 + j][dd]), qd, acc[j]);
    }
    for (int j = 0; j < 8; ++j) _mm512_store_ps(st + (k0 + j) * kTQ, acc[j]);
  }
}

BATCHGEN_ATTN_BF16_TARGET inline void scores_bf16(const bf16_t* const* rows, int64_t live,
                                                  int64_t d, const bf16_t* qv, float* st) {
  for (int64_t k0 = 0; k0 < live; k0 += 8) {
    __m512 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d / 2; ++i) {
      const __m512bh qd = (__m512bh)_mm512_load_si512(qv + i * 2 * kTQ);
      for (int j = 0; j < 8; ++j) {
        int32_t pair;
        std::memcpy(&pair, rows[k0 + j] + 2 * i, 4);
        acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_set1_epi32(pair), qd);
      }
    }
    for (int j = 0; j < 8; ++j) _mm512_store_ps(st + (k0 + j) * kTQ, acc[j]);
  }
}

// One head's online softmax step on its raw scores st [32][16] (rows < live): masks hidden
// keys, updates the running max m and sum l (16 lanes each), leaves the unnormalised weights
// P^T in st (0 for hidden keys), and writes alpha[q] = e^(scale (m - m')); returns whether
// some lane's max grew (O needs the rescale).
BATCHGEN_PREFILL_F32_TARGET inline bool softmax_block(const Task& t, int64_t window, float scale,
                                                      int64_t kb, int64_t nk, bool masked,
                                                      int64_t live, float* st, float* m,
                                                      float* l, float* alpha) {
  const __m512 vscale = _mm512_set1_ps(scale), masked_v = _mm512_set1_ps(kMasked);
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i pos = _mm512_add_epi32(_mm512_set1_epi32(int(t.p0)), lanes);
  const __m512i win = _mm512_set1_epi32(int(window));
  const __m512 m_old = _mm512_loadu_ps(m);
  __m512 mx = m_old;
  for (int64_t k = 0; k < live; ++k) {
    __m512 x = _mm512_load_ps(st + k * kTQ);
    if (masked) {
      const __m512i j = _mm512_set1_epi32(int(kb + k));
      __mmask16 vis = k < nk ? _mm512_cmple_epi32_mask(j, pos) : __mmask16(0);
      if (window > 0) vis &= _mm512_cmplt_epi32_mask(_mm512_sub_epi32(pos, j), win);
      x = _mm512_mask_mov_ps(masked_v, vis, x);
    }
    _mm512_store_ps(st + k * kTQ, x);
    mx = _mm512_max_ps(mx, x);
  }
  const __m512 mx_scaled = _mm512_mul_ps(mx, vscale);
  __m512 rsum = _mm512_setzero_ps();
  for (int64_t k = 0; k < live; ++k) {
    const __m512 p = exp_ps(_mm512_fmsub_ps(_mm512_load_ps(st + k * kTQ), vscale, mx_scaled));
    rsum = _mm512_add_ps(rsum, p);
    _mm512_store_ps(st + k * kTQ, p);
  }
  _mm512_storeu_ps(m, mx);
  if (_mm512_cmp_ps_mask(mx, m_old, _CMP_GT_OQ)) {
    const __m512 al = exp_ps(_mm512_fmsub_ps(m_old, vscale, mx_scaled));
    _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), al, rsum));
    _mm512_storeu_ps(alpha, al);
    return true;
  }
  _mm512_storeu_ps(l, _mm512_add_ps(_mm512_loadu_ps(l), rsum));
  return false;
}

// O[q][:] *= alpha[q] for the task's queries (O [16][D]).
BATCHGEN_PREFILL_F32_TARGET inline void rescale_o(float* o, const float* alpha, int64_t nq,
                                                  int64_t d) {
  for (int64_t q = 0; q < nq; ++q) {
    const __m512 al = _mm512_set1_ps(alpha[q]);
    for (int64_t c = 0; c < d; c += 16)
      _mm512_store_ps(o + q * d + c, _mm512_mul_ps(_mm512_load_ps(o + q * d + c), al));
  }
}

// O[q][c .. c + 16 NC) += sum_k P^T[k][q] V[k][...] for queries q0 .. q0 + NQ - 1, keys
// k < nk (vrows their cache rows), P^T float32 [32][16].
template <int NQ, int NC>
BATCHGEN_PREFILL_F32_TARGET inline void pv_f32(float* o, int64_t d, int64_t q0, int64_t c,
                                               const float* const* vrows, int64_t nk,
                                               const float* pt) {
  __m512 acc[NQ][NC];
  for (int i = 0; i < NQ; ++i)
    for (int j = 0; j < NC; ++j) acc[i][j] = _mm512_load_ps(o + (q0 + i) * d + c + 16 * j);
  for (int64_t k = 0; k < nk; ++k) {
    __m512 v[NC];
    for (int j = 0; j < NC; ++j) v[j] = _mm512_loadu_ps(vrows[k] + c + 16 * j);
    for (int i = 0; i < NQ; ++i) {
      const __m512 p = _mm512_set1_ps(pt[k * kTQ + q0 + i]);
      for (int j = 0; j < NC; ++j) acc[i][j] = _mm512_fmadd_ps(p, v[j], acc[i][j]);
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int j = 0; j < NC; ++j) _mm512_store_ps(o + (q0 + i) * d + c + 16 * j, acc[i][j]);
}

// The bf16 twin: pairs of keys kp < npairs; vp [16 pairs][D][2] (the block's V rows
// interleaved), pv [16 pairs][16 queries][2] (P^T rounded to bf16).
template <int NQ, int NC>
BATCHGEN_ATTN_BF16_TARGET inline void pv_bf16(float* o, int64_t d, int64_t q0, int64_t c,
                                              const bf16_t* vp, int64_t npairs,
                                              const bf16_t* pv) {
  __m512 acc[NQ][NC];
  for (int i = 0; i < NQ; ++i)
    for (int j = 0; j < NC; ++j) acc[i][j] = _mm512_load_ps(o + (q0 + i) * d + c + 16 * j);
  for (int64_t kp = 0; kp < npairs; ++kp) {
    __m512bh v[NC];
    for (int j = 0; j < NC; ++j)
      v[j] = (__m512bh)_mm512_load_si512(vp + kp * 2 * d + 2 * (c + 16 * j));
    for (int i = 0; i < NQ; ++i) {
      int32_t pair;
      std::memcpy(&pair, pv + kp * 2 * kTQ + 2 * (q0 + i), 4);
      const __m512bh p = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NC; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], p, v[j]);
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int j = 0; j < NC; ++j) _mm512_store_ps(o + (q0 + i) * d + c + 16 * j, acc[i][j]);
}

// P V of one head for the task's nq queries: 4 queries x 4 x 16 dimensions per pass.
template <class T, class Src>
inline void pv_head(float* o, int64_t d, int64_t nq, Src src, int64_t n, const void* p) {
  for (int64_t c = 0; c < d; c += 64) {
    const int64_t nc = std::min<int64_t>(4, (d - c) / 16);
    for (int64_t q0 = 0; q0 < nq; q0 += 4) {
      auto pass = [&](auto nq_c, auto nc_c) {
        constexpr int kQ = decltype(nq_c)::value, kC = decltype(nc_c)::value;
        if constexpr (std::is_same_v<T, float>)
          pv_f32<kQ, kC>(o, d, q0, c, src, n, static_cast<const float*>(p));
        else
          pv_bf16<kQ, kC>(o, d, q0, c, src, n, static_cast<const bf16_t*>(p));
      };
      auto by_nc = [&](auto nq_c) {
        switch (nc) {
          case 4: return pass(nq_c, std::integral_constant<int, 4>{});
          case 3: return pass(nq_c, std::integral_constant<int, 3>{});
          case 2: return pass(nq_c, std::integral_constant<int, 2>{});
          default: return pass(nq_c, std::integral_constant<int, 1>{});
        }
      };
      switch (std::min<int64_t>(4, nq - q0)) {
        case 4: by_nc(std::integral_constant<int, 4>{}); break;
        case 3: by_nc(std::integral_constant<int, 3>{}); break;
        case 2: by_nc(std::integral_constant<int, 2>{}); break;
        default: by_nc(std::integral_constant<int, 1>{});
      }
    }
  }
}

// P^T float32 [32][16] (rows < live) -> bf16 key pairs [live / 2][16][2], rounded to nearest
// even (word 2q of pair row kp: key 2kp at query q; word 2q + 1: key 2kp + 1).
BATCHGEN_ATTN_BF16_TARGET inline void pairs_bf16(const float* pt, int64_t live, bf16_t* pv) {
  alignas(64) static constexpr int16_t kPairs[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                                     21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26,
                                                     11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i pairs = _mm512_load_si512(kPairs);
  for (int64_t kp = 0; kp < live / 2; ++kp) {
    const __m512 p0 = _mm512_load_ps(pt + 2 * kp * kTQ);
    const __m512 p1 = _mm512_load_ps(pt + (2 * kp + 1) * kTQ);
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);  // [p0 x 16, p1 x 16]
    _mm512_store_si512(pv + kp * 32, _mm512_permutexvar_epi16(pairs, both));
  }
}

// The block's V rows (nk of them; a missing odd partner reads zero_row) as key pairs
// [16 pairs][D][2]: per 32 dimensions, rows 2kp and 2kp + 1 word-interleaved.
BATCHGEN_ATTN_BF16_TARGET inline void pack_v_pairs(const bf16_t* const* rows, int64_t nk,
                                                   int64_t d, const bf16_t* zero_row,
                                                   bf16_t* vp) {
  alignas(64) static constexpr int16_t kLo[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                  37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                  11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i ilo = _mm512_load_si512(kLo);
  const __m512i ihi = _mm512_add_epi16(ilo, _mm512_set1_epi16(16));
  for (int64_t kp = 0; kp < (nk + 1) / 2; ++kp) {
    const bf16_t* r0 = rows[2 * kp];
    const bf16_t* r1 = 2 * kp + 1 < nk ? rows[2 * kp + 1] : zero_row;
    for (int64_t c = 0; c < d; c += 32) {
      const __m512i a = _mm512_loadu_si512(r0 + c), b = _mm512_loadu_si512(r1 + c);
      _mm512_store_si512(vp + kp * 2 * d + 2 * c, _mm512_permutex2var_epi16(a, ilo, b));
      _mm512_store_si512(vp + kp * 2 * d + 2 * c + 32, _mm512_permutex2var_epi16(a, ihi, b));
    }
  }
}

// out rows of the task: O[h][q][:] / l[h][q], rounded once for bf16.
template <class C>
BATCHGEN_PREFILL_F32_TARGET inline void write_out_f32(const Args<float, C>& a, const Task& t,
                                                      const float* o, const float* l) {
  const int64_t g = a.hq / a.hkv, d = a.d, tok0 = a.spans[4 * t.span] + t.i0;
  for (int64_t h = 0; h < g; ++h)
    for (int64_t q = 0; q < t.nq; ++q) {
      const __m512 inv = _mm512_set1_ps(a.v_scale / l[h * kTQ + q]);
      float* dst = a.out + ((tok0 + q) * a.hq + t.kv * g + h) * d;
      for (int64_t c = 0; c < d; c += 16)
        _mm512_storeu_ps(dst + c, _mm512_mul_ps(_mm512_load_ps(o + (h * kTQ + q) * d + c), inv));
    }
}

template <class C>
BATCHGEN_ATTN_BF16_TARGET inline void write_out_bf16(const Args<bf16_t, C>& a, const Task& t,
                                                     const float* o, const float* l) {
  const int64_t g = a.hq / a.hkv, d = a.d, tok0 = a.spans[4 * t.span] + t.i0;
  for (int64_t h = 0; h < g; ++h)
    for (int64_t q = 0; q < t.nq; ++q) {
      const __m512 inv = _mm512_set1_ps(a.v_scale / l[h * kTQ + q]);
      bf16_t* dst = a.out + ((tok0 + q) * a.hq + t.kv * g + h) * d;
      for (int64_t c = 0; c < d; c += 16) {
        const __m512 x = _mm512_mul_ps(_mm512_load_ps(o + (h * kTQ + q) * d + c), inv);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c), (__m256i)_mm512_cvtneps_pbh(x));
      }
    }
}
#endif

}  // namespace
