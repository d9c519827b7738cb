// The AVX-512 path of the prefill attention kernel, for CPUs without AMX (prefill_attention.cpp
// includes this after Args, Task, Scratch and the generic path). One task: 16 query tokens x the
// G query heads of one KV head; per block of 32 keys and per head:
//   S^T     [32 keys][16 queries], the queries in the lanes: 8 keys at a time, 8 independent
//           accumulators; per dimension (float32: `vfmadd231ps`) or pair of dimensions (bf16:
//           `vdpbf16ps`, products exact, float32 sums), one load of Q^T's row (packed once per
//           task: [D][16] float32, or [D / 2][16][2] bf16 pairs) and the key's element(s)
//           broadcast straight from its cache row (no copy of K);
//   softmax per query lane (vertical ops), as the AMX path: mask, running max on the raw
//           scores, `exp_ps` of scale (s - m'), float32 sums l; O and l rescaled only when some
//           lane's max grew; bf16 rounds P to bf16 (`vcvtne2ps2bf16`, round to nearest even)
//           into key pairs [16 pairs][16 queries][2];
//   O       [16 queries][D] float32, not transposed (the output rows need no transpose):
//           16 accumulators (4 queries x 64 dimensions) per pass; per key (float32) or pair of
//           keys (bf16), the V row's 64 dimensions loaded (float32: from the cache row; bf16:
//           the block's rows interleaved in key pairs once per block, [16 pairs][D][2],
//           `vpermt2w`) and each query's weight(s) broadcast.
// Numerics as the AMX path's: float32 products and sums (bf16 products exact), P rounded to
// bf16 before P V in bf16 (l from the unrounded weights), the output rounded once.
// Serves float32 with AVX-512F (D % 16 == 0) and bf16 with AVX512-BF16 (D % 32 == 0), on a cache
// of q's dtype (read in place) or a narrower one (each block's rows converted once per task of
// two tiles, `run_task_vec`; bf16 q on fp8: converted to bf16 exactly, so `vdpbf16ps` stays:
// the float32-FMA route would do the float32 kernel's work, 1.5-1.7x the bf16 path's time).
// The per-block steps it calls (scores, softmax, P V, packing, output rows) are in
// prefill_attention_vec_steps.h.
#pragma once

#include "prefill_attention_vec_steps.h"  // scores_*, softmax_block, pv_head, write_out_*

namespace {

#if BATCHGEN_HAVE_BF16

inline bool avx512_usable() {
  static const bool usable = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq");
  }();
  return usable;
}

// The AVX-512 path serves head size d: float32 D % 16 == 0 and AVX-512F/BW/DQ; bf16 D % 32 == 0
// and avx512_bf16 as well.
inline bool vec_path_usable(bool bf16, int64_t d) {
  if (d <= 0 || !avx512_usable()) return false;
  return bf16 ? d % 32 == 0 && avx512_bf16_usable() : d % 16 == 0;
}

// One task on the AVX-512 path (float32 or bf16 q): `nt` (1 or 2) consecutive 16-token tiles
// of one span and KV head sharing each key block (the later tile sees more keys; a block a
// tile cannot see is skipped), as the AMX path's tasks. A cache of another dtype C
// (kv_cache_dtype, run with two tiles) has each block's K rows staged in q's compute type
// (`stage_row`) and its V rows too (float32) or converted straight into key pairs (bf16,
// `stage_pair`), once for both tiles: exact, divided by kVecUnit<C>, which `run` folded into
// a.scale and a.v_scale. A cache of q's dtype is read in place.
template <class T, class C>
void run_task_vec(const Args<T, C>& a, const Task* tiles, int64_t nt, Scratch& s) {
  constexpr bool kBf16 = std::is_same_v<T, bf16_t>, kStaged = !std::is_same_v<T, C>;
  const int64_t g = a.hq / a.hkv, d = a.d, per_tile = g * kTQ * d;
  if constexpr (kBf16)
    s.qv.assign(nt * per_tile, 0);
  else
    s.qt.assign(nt * per_tile, 0.0f);
  for (int64_t ti = 0; ti < nt; ++ti) pack_q_vec(a, tiles[ti], ti, s);
  s.ot.assign(nt * per_tile, 0.0f);  // O [tile][G][16][D]
  s.m.assign(nt * g * kTQ, kInitMax);
  s.l.assign(nt * g * kTQ, 0.0f);
  s.s.resize(kBK * kTQ);
  if constexpr (kBf16) {
    s.vt.resize(kBK * d + d);  // V key pairs [16][D][2], then a zero row
    std::fill(s.vt.begin() + kBK * d, s.vt.end(), bf16_t(0));
    s.pv.resize(kBK * kTQ);
  }
  T* kstage = nullptr;  // [32][D] K rows in T (kStaged); float32: V rows too
  float* vstage = nullptr;
  if constexpr (kStaged) {
    if constexpr (kBf16) {
      s.kb.resize(kBK * d);
      kstage = s.kb.data();
    } else {
      s.kp.resize(kBK * d);
      s.vp.resize(kBK * d);
      kstage = s.kp.data(), vstage = s.vp.data();
    }
  }
  alignas(64) float alpha[kTQ];
  const T* krows[kBK];
  const T* vrows[kBK];
  const int64_t lo = tiles[0].lo, hi = tiles[nt - 1].hi;
  for (int64_t kb = lo; kb <= hi; kb += kBK) {
    const int64_t nk = std::min(kBK, hi + 1 - kb);
    for (int64_t k = 0; k < kBK; ++k) {
      const int64_t j = std::min(k, nk - 1);
      if constexpr (kStaged) {
        if (k < nk) stage_row(cache_row(a.k_cache, a, tiles[0], kb + k), d, kstage + k * d);
        krows[k] = kstage + j * d;
        if constexpr (!kBf16) {
          if (k < nk) stage_row(cache_row(a.v_cache, a, tiles[0], kb + k), d, vstage + k * d);
          vrows[k] = vstage + j * d;
        }
      } else {
        krows[k] = cache_row(a.k_cache, a, tiles[0], kb + j);
        vrows[k] = cache_row(a.v_cache, a, tiles[0], kb + j);
      }
    }
    // bf16 V as key pairs [16][D][2]; a missing odd partner reads zeros
    auto v_pair = [&](int64_t kp, int64_t n) {
      if constexpr (kBf16 && kStaged) {
        const C* r0 = cache_row(a.v_cache, a, tiles[0], kb + 2 * kp);
        const C* r1 = 2 * kp + 1 < n ? cache_row(a.v_cache, a, tiles[0], kb + 2 * kp + 1)
                                     : nullptr;
        stage_pair(r0, r1, d, s.vt.data() + kp * 2 * d);
      }
    };
    if constexpr (kBf16 && kStaged) {
      for (int64_t kp = 0; kp < (nk + 1) / 2; ++kp) v_pair(kp, nk);
    } else if constexpr (kBf16) {
      pack_v_pairs(vrows, nk, d, s.vt.data() + kBK * d, s.vt.data());
    }
    for (int64_t ti = 0; ti < nt; ++ti) {
      const Task& t = tiles[ti];
      if (kb > t.hi || kb + nk - 1 < t.lo) continue;  // no key of the block visible to the tile
      const int64_t tnk = std::min(nk, t.hi + 1 - kb);  // keys past the tile's last are hidden
      const int64_t live = tnk <= 16 ? 16 : kBK;  // keys scored: past tnk masked (weight 0)
      const bool masked = block_needs_mask(t, a.window, kb, tnk);
      // The pair holding the tile's last key and a later one: the later one's weight is 0,
      // but 0 x an inf / NaN value is NaN; that pair reads a zero partner for this tile.
      const bool odd_cut = kBf16 && kStaged && tnk < nk && tnk % 2;
      if constexpr (kBf16 && kStaged)
        if (odd_cut) v_pair(tnk / 2, tnk);
      for (int64_t h = 0; h < g; ++h) {
        float* st = s.s.data();
        float* o = s.ot.data() + ti * per_tile + h * kTQ * d;
        float* m = s.m.data() + (ti * g + h) * kTQ;
        float* l = s.l.data() + (ti * g + h) * kTQ;
        if constexpr (kBf16)
          scores_bf16(krows, live, d, s.qv.data() + ti * per_tile + h * d * kTQ, st);
        else
          scores_f32(krows, live, d, s.qt.data() + ti * per_tile + h * d * kTQ, st);
        if (softmax_block(t, a.window, a.scale, kb, tnk, masked, live, st, m, l, alpha))
          rescale_o(o, alpha, t.nq, d);
        if constexpr (kBf16) {
          pairs_bf16(st, live, s.pv.data());
          pv_head<T>(o, d, t.nq, s.vt.data(), (tnk + 1) / 2, s.pv.data());
        } else {
          pv_head<T>(o, d, t.nq, vrows, tnk, st);
        }
      }
      if constexpr (kBf16 && kStaged)
        if (odd_cut) v_pair(tnk / 2, nk);  // back for the later tile
    }
  }
  for (int64_t ti = 0; ti < nt; ++ti) {
    if constexpr (kBf16)
      write_out_bf16(a, tiles[ti], s.ot.data() + ti * per_tile, s.l.data() + ti * g * kTQ);
    else
      write_out_f32(a, tiles[ti], s.ot.data() + ti * per_tile, s.l.data() + ti * g * kTQ);
  }
}
#else
inline bool vec_path_usable(bool, int64_t) { return false; }
template <class T, class C>
void run_task_vec(const Args<T, C>&, const Task*, int64_t, Scratch&) {}
#endif

}  // namespace
