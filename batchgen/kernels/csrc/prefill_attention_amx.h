// The AMX-BF16 path of the prefill attention kernel (prefill_attention.cpp includes this after
// Args, Task, Scratch and write_out). One task: 16 query tokens x the G query heads of one KV
// head; per block of 32 keys:
//   pack    the 32 key rows, row-major [32][D] bf16 (A of S^T: 16 keys x 32 dims per tile,
//           copied from their cache slots), and V^T [D][32] bf16 (A of O^T: 16 dims x 32 keys);
//           both zero past the last key;
//   S^T     per head: C [16 keys][16 queries] += A (16 key rows x 32 dims) . B (Q^T as pairs of
//           dimensions [16 pairs][16 queries][2], packed once per task), D / 32 steps, two
//           key tiles;
//   softmax per query lane (vertical AVX-512 ops): scale, mask, running max, `exp_ps`, the
//           float32 row sums; P^T rounded to bf16 into pairs of keys [16 pairs][16 queries][2]
//           (`vcvtne2ps2bf16` + one word permute);
//   O^T     rescaled by e^(m - m') in memory, loaded into C, += A (V^T 16 dims x 32 keys) . B
//           (P^T), stored back: D / 16 tiles.
// Tiles: 0 S^T, 1 K, 2 Q^T, 3 O^T, 4 V^T, 5 P^T; all 16 rows x 64 bytes (`amx_tile_config`).
#pragma once

namespace {

#if BATCHGEN_HAVE_AMX && BATCHGEN_HAVE_BF16
#define BATCHGEN_PREFILL_AMX_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16,amx-tile,amx-bf16")))

// The AMX path serves head size d: a multiple of 32 up to 512, and the CPU has AMX-BF16 (with the tile
// state granted) and avx512_bf16.
inline bool amx_path_usable(int64_t d) {
  return d > 0 && d % 32 == 0 && d <= 512 && avx512_bf16_usable() && amx_usable();
}

BATCHGEN_PREFILL_AMX_TARGET void run_task_amx(const Args<bf16_t>& a, const Task& t, Scratch& s) {
  const int64_t g = a.hq / a.hkv, d = a.d, steps = d / 32;
  const int64_t tok0 = a.spans[4 * t.span] + t.i0;
  s.qv.assign(g * d * kTQ, 0);  // [G][D / 2][16][2]
  s.ot.assign(g * d * kTQ, 0.0f);
  s.m.assign(g * kTQ, kInitMax);
  s.l.assign(g * kTQ, 0.0f);
  s.kb.resize(kBK * d);
  s.vt.resize(d * kBK);
  s.pv.resize(kBK * kTQ);
  s.s.resize(kBK * kTQ);
  for (int64_t h = 0; h < g; ++h)
    for (int64_t q = 0; q < t.nq; ++q) {
      uint32_t qr[256];  // one query row as words (pairs of dimensions); d <= 512 here
      std::memcpy(qr, a.q + ((tok0 + q) * a.hq + t.kv * g + h) * d, d * sizeof(bf16_t));
      uint32_t* dst = reinterpret_cast<uint32_t*>(s.qv.data() + h * d * kTQ);
      for (int64_t dp = 0; dp < d / 2; ++dp) dst[dp * kTQ + q] = qr[dp];
    }
  amx_tile_config();
  // Word 2q of a P^T pair row is key 2kp at query q, word 2q + 1 key 2kp + 1.
  alignas(64) static constexpr int16_t kPairs[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                                     21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26,
                                                     11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i pairs = _mm512_load_si512(kPairs);
  const __m512 vscale = _mm512_set1_ps(a.scale), masked_v = _mm512_set1_ps(kMasked);
  const __m512i pos = _mm512_add_epi32(_mm512_set1_epi32(int(t.p0)),
                                       _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                         12, 13, 14, 15));
  const __m512i window = _mm512_set1_epi32(int(a.window));
  float* st = s.s.data();
  for (int64_t kb = t.lo; kb <= t.hi; kb += kBK) {
    const int64_t nk = std::min(kBK, t.hi + 1 - kb);
    bf16_t* kbuf = s.kb.data();
    bf16_t* vt = s.vt.data();
    for (int64_t k = 0; k < nk; ++k) {
      std::memcpy(kbuf + k * d, cache_row(a.k_cache, a, t, kb + k), d * sizeof(bf16_t));
      const bf16_t* vr = cache_row(a.v_cache, a, t, kb + k);
      for (int64_t dd = 0; dd < d; ++dd) vt[dd * kBK + k] = vr[dd];
    }
    for (int64_t k = nk; k < kBK; ++k) {
      std::memset(kbuf + k * d, 0, d * sizeof(bf16_t));
      for (int64_t dd = 0; dd < d; ++dd) vt[dd * kBK + k] = 0;
    }
    const bool masked = block_needs_mask(t, a.window, kb, nk);
    for (int64_t h = 0; h < g; ++h) {
      const bf16_t* qv = s.qv.data() + h * d * kTQ;
      for (int64_t tk = 0; tk < kBK / 16; ++tk) {  // S^T, 16 keys at a time
        _tile_zero(0);
        for (int64_t c = 0; c < steps; ++c) {
          _tile_loadd(1, kbuf + tk * 16 * d + 32 * c, d * 2);
          _tile_loadd(2, qv + 512 * c, 64);
          _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, st + tk * 16 * kTQ, 64);
      }
      float* m = s.m.data() + h * kTQ;
      float* l = s.l.data() + h * kTQ;
      const __m512 m_old = _mm512_loadu_ps(m);
      __m512 mx = m_old;
      for (int64_t k = 0; k < kBK; ++k) {
        __m512 x = _mm512_mul_ps(_mm512_loadu_ps(st + k * kTQ), vscale);
        if (masked) {
          const __m512i j = _mm512_set1_epi32(int(kb + k));
          __mmask16 vis = k < nk ? _mm512_cmple_epi32_mask(j, pos) : __mmask16(0);
          if (a.window > 0) vis &= _mm512_cmplt_epi32_mask(_mm512_sub_epi32(pos, j), window);
          x = _mm512_mask_mov_ps(masked_v, vis, x);
        }
        _mm512_storeu_ps(st + k * kTQ, x);
        mx = _mm512_max_ps(mx, x);
      }
      const __m512 alpha = exp_ps(_mm512_sub_ps(m_old, mx));
      __m512 rsum = _mm512_setzero_ps();
      bf16_t* pv = s.pv.data();
      for (int64_t kp = 0; kp < kBK / 2; ++kp) {
        const __m512 p0 = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(st + 2 * kp * kTQ), mx));
        const __m512 p1 = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(st + (2 * kp + 1) * kTQ), mx));
        rsum = _mm512_add_ps(rsum, _mm512_add_ps(p0, p1));
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);  // [p0 x 16, p1 x 16]
        _mm512_storeu_si512(pv + kp * 32, _mm512_permutexvar_epi16(pairs, both));
      }
      _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), alpha, rsum));
      _mm512_storeu_ps(m, mx);
      float* ot = s.ot.data() + h * d * kTQ;
      for (int64_t dd = 0; dd < d; ++dd)
        _mm512_storeu_ps(ot + dd * kTQ, _mm512_mul_ps(_mm512_loadu_ps(ot + dd * kTQ), alpha));
      _tile_loadd(5, pv, 64);
      for (int64_t dt = 0; dt < d / 16; ++dt) {  // O^T, 16 dimensions at a time
        _tile_loadd(3, ot + dt * 16 * kTQ, 64);
        _tile_loadd(4, vt + dt * 16 * kBK, kBK * 2);
        _tile_dpbf16ps(3, 4, 5);
        _tile_stored(3, ot + dt * 16 * kTQ, 64);
      }
    }
  }
  _tile_release();
  write_out(a, t, s.ot.data(), s.l.data());
}
#else
inline bool amx_path_usable(int64_t) { return false; }
inline void run_task_amx(const Args<bf16_t>&, const Task&, Scratch&) {}
#endif

}  // namespace
