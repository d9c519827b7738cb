// The AMX-BF16 path of the prefill attention kernel (prefill_attention.cpp includes this after
// Args, Task, Scratch and write_out). One task: 16 query tokens x the G query heads of one KV
// head; per block of 32 keys:
//   pack    the 32 key rows, row-major [32][D] bf16 (A of S^T: 16 keys x 32 dims per tile,
//           copied from their cache slots), and V^T [D][32] bf16 (A of O^T: 16 dims x 32 keys;
//           `pack_vt`: word interleave + 16 x 16 word transposes); both zero past the last key;
//   S^T     two heads at a time: C [16 keys][16 queries] += A (16 key rows x 32 dims) . B (Q^T
//           as pairs of dimensions [16 pairs][16 queries][2], packed once per task), D / 32
//           steps; four independent accumulators (2 heads x 2 key tiles, `scores2`), the K
//           tiles loaded once for both heads;
//   softmax per query lane (vertical AVX-512 ops) on the raw scores: mask, running max, `exp_ps`
//           of scale (s - m'), the float32 row sums; P^T rounded to bf16 into pairs of keys
//           [16 pairs][16 queries][2] (`vcvtne2ps2bf16` + one word permute); O^T and l are
//           rescaled by e^(scale (m - m')) only when some lane's max grew;
//   O^T     loaded into C, += A (V^T 16 dims x 32 keys) . B (P^T), stored back: four
//           independent accumulators of 16 dimensions (`pv4`).
// A task holds two query tiles where the span has them (the key blocks packed once for both).
// Single thread, process CPU time, bench shapes (Hq 8, Hkv 2, D 64), loaded machine, against
// torch's SDPA path (docs/performance.md, "Prefill attention kernel"): 1.2x on a first chunk of
// 512 or 2,048 tokens, 1.35x on twelve first chunks of 32-1,024 tokens, 1.55x / 2.2x for 512 /
// 2,048 tokens after 1,024 cached (no gathered copy of the context, no mask); perf puts about
// half the time in the softmax (the exp), 17% in S^T, 13% in P V, 12% in packing.
#pragma once

namespace {

#if BATCHGEN_HAVE_AMX && BATCHGEN_HAVE_BF16
#define BATCHGEN_PREFILL_AMX_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16,amx-tile,amx-bf16")))

// The AMX path serves head size d: a multiple of 32 up to 512, and the CPU has AMX-BF16 (with
// the tile state granted) and avx512_bf16.
inline bool amx_path_usable(int64_t d) {
  return d > 0 && d % 32 == 0 && d <= 512 && avx512_bf16_usable() && amx_usable();
}

// r[i][l] -> r[l][i] for a 16 x 16 matrix of 32-bit words: four levels of swapping the
// off-diagonal s x s blocks of every 2s x 2s block (s = 8, 4, 2, 1), one `vpermt2d` per row and
// level: row i (bit s clear) takes row i + s's lanes l - s into its lanes with bit s set, row
// i + s takes row i's lanes l + s into its lanes with bit s clear.
// kTransposeIdx[level][0 / 1][l]: the vpermt2d indices of rows i and i + s at s = 8 >> level.
struct TransposeIdx {
  alignas(64) int32_t v[4][2][16];
  constexpr TransposeIdx() : v() {
    for (int level = 0; level < 4; ++level)
      for (int l = 0; l < 16; ++l) {
        const int s = 8 >> level;
        v[level][0][l] = (l & s) ? 16 + l - s : l;
        v[level][1][l] = (l & s) ? 16 + l : l + s;
      }
  }
};
alignas(64) constexpr TransposeIdx kTransposeIdx{};

BATCHGEN_PREFILL_AMX_TARGET inline void transpose16x16_epi32(__m512i* r) {
  for (int level = 0; level < 4; ++level) {
    const int s = 8 >> level;
    const __m512i ilo = _mm512_load_si512(kTransposeIdx.v[level][0]);
    const __m512i ihi = _mm512_load_si512(kTransposeIdx.v[level][1]);
    for (int i = 0; i < 16; ++i)
      if ((i & s) == 0) {
        const __m512i a = r[i], b = r[i + s];
        r[i] = _mm512_permutex2var_epi32(a, ilo, b);
        r[i + s] = _mm512_permutex2var_epi32(a, ihi, b);
      }
  }
}

// V^T [D][32] bf16 of the key rows rows[0 .. 31] (D elements each): per 32 dimensions, the
// rows' key pairs interleaved into words (dims 0-15 and 16-31: 16 pairs x 16 dims), then each
// 16 x 16 word block transposed: row dd = (V[0][dd], V[1][dd]), (V[2][dd], V[3][dd]), ...
BATCHGEN_PREFILL_AMX_TARGET inline void pack_vt(const bf16_t* const* rows, int64_t d,
                                                bf16_t* vt) {
  alignas(64) static constexpr int16_t kLo[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                  37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                  11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr int16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21,
                                                  53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58,
                                                  27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i ilo = _mm512_load_si512(kLo), ihi = _mm512_load_si512(kHi);
  for (int64_t c = 0; c < d; c += 32) {
    __m512i wlo[16], whi[16];
    for (int kp = 0; kp < 16; ++kp) {
      const __m512i r0 = _mm512_loadu_si512(rows[2 * kp] + c);
      const __m512i r1 = _mm512_loadu_si512(rows[2 * kp + 1] + c);
      wlo[kp] = _mm512_permutex2var_epi16(r0, ilo, r1);
      whi[kp] = _mm512_permutex2var_epi16(r0, ihi, r1);
    }
    transpose16x16_epi32(wlo);
    transpose16x16_epi32(whi);
    for (int i = 0; i < 16; ++i) {
      _mm512_storeu_si512(vt + (c + i) * kBK, wlo[i]);
      _mm512_storeu_si512(vt + (c + 16 + i) * kBK, whi[i]);
    }
  }
}

// S^T [32 keys][16 queries] of two heads (their packed Q^T q0, q1) against the block's 32 key
// rows: four independent accumulator tiles (0, 1: head 0's key tiles; 2, 3: head 1's), the K
// tiles loaded once for both heads. Tiles: C 0-3, K 4-5, Q^T 6-7.
BATCHGEN_PREFILL_AMX_TARGET inline void scores2(const bf16_t* kbuf, int64_t d, const bf16_t* q0,
                                                const bf16_t* q1, float* s0, float* s1) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t c = 0; c < d / 32; ++c) {
    _tile_loadd(4, kbuf + 32 * c, d * 2);
    _tile_loadd(5, kbuf + 16 * d + 32 * c, d * 2);
    _tile_loadd(6, q0 + 512 * c, 64);
    _tile_loadd(7, q1 + 512 * c, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, s0, 64);
  _tile_stored(1, s0 + 16 * kTQ, 64);
  _tile_stored(2, s1, 64);
  _tile_stored(3, s1 + 16 * kTQ, 64);
}

// scores2 for one head.
BATCHGEN_PREFILL_AMX_TARGET inline void scores1(const bf16_t* kbuf, int64_t d, const bf16_t* q0,
                                                float* s0) {
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t c = 0; c < d / 32; ++c) {
    _tile_loadd(4, kbuf + 32 * c, d * 2);
    _tile_loadd(5, kbuf + 16 * d + 32 * c, d * 2);
    _tile_loadd(6, q0 + 512 * c, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
  }
  _tile_stored(0, s0, 64);
  _tile_stored(1, s0 + 16 * kTQ, 64);
}

// O^T[16 dt + i][q] += sum_k V^T[16 dt + i][k] P^T[k][q] for dt < n (1 .. 4 tiles of 16
// dimensions): ot [16 n][16] float32, vt rows of 32 keys, pv the P^T pairs. Independent
// accumulators 0-3, V^T tiles 4, 5, 7 in turn, P^T 6.
BATCHGEN_PREFILL_AMX_TARGET inline void pv4(float* ot, const bf16_t* vt, const bf16_t* pv,
                                            int64_t n) {
  _tile_loadd(6, pv, 64);
  _tile_loadd(0, ot, 64);
  _tile_loadd(4, vt, kBK * 2);
  if (n > 1) _tile_loadd(1, ot + 16 * kTQ, 64);
  if (n > 1) _tile_loadd(5, vt + 16 * kBK, kBK * 2);
  _tile_dpbf16ps(0, 4, 6);
  if (n > 2) _tile_loadd(2, ot + 32 * kTQ, 64);
  if (n > 2) _tile_loadd(7, vt + 32 * kBK, kBK * 2);
  if (n > 1) _tile_dpbf16ps(1, 5, 6);
  if (n > 3) _tile_loadd(3, ot + 48 * kTQ, 64);
  if (n > 3) _tile_loadd(4, vt + 48 * kBK, kBK * 2);
  if (n > 2) _tile_dpbf16ps(2, 7, 6);
  if (n > 3) _tile_dpbf16ps(3, 4, 6);
  _tile_stored(0, ot, 64);
  if (n > 1) _tile_stored(1, ot + 16 * kTQ, 64);
  if (n > 2) _tile_stored(2, ot + 32 * kTQ, 64);
  if (n > 3) _tile_stored(3, ot + 48 * kTQ, 64);
}

// Q^T of query head h of the tile as pairs of dimensions, [D / 2][16 queries] words: per 32
// dimensions, the 16 query rows' 16 words transposed (rows past nq are zeros).
BATCHGEN_PREFILL_AMX_TARGET inline void pack_q(const Args<bf16_t>& a, const Task& t, int64_t h,
                                               bf16_t* qv) {
  const int64_t g = a.hq / a.hkv, d = a.d;
  const bf16_t* q0 = a.q + (a.spans[4 * t.span] + t.i0) * a.q_stride + (t.kv * g + h) * d;
  for (int64_t c = 0; c < d; c += 32) {
    __m512i r[16];
    for (int64_t q = 0; q < 16; ++q)
      r[q] = q < t.nq ? _mm512_loadu_si512(q0 + q * a.q_stride + c) : _mm512_setzero_si512();
    transpose16x16_epi32(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(qv + (c + 2 * i) * kTQ, r[i]);
  }
}

// write_out for the AMX path: per 16 dimensions, O^T's rows times v_scale / l (lanes are
// queries), transposed to query rows, rounded to bf16 (`vcvtneps2bf16`, round to nearest even).
BATCHGEN_PREFILL_AMX_TARGET inline void write_out_amx(const Args<bf16_t>& a, const Task& t,
                                                      const float* ot, const float* l) {
  const int64_t g = a.hq / a.hkv, d = a.d;
  const int64_t tok0 = a.spans[4 * t.span] + t.i0;
  for (int64_t h = 0; h < g; ++h) {
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(a.v_scale), _mm512_loadu_ps(l + h * kTQ));
    const float* oh = ot + h * d * kTQ;
    bf16_t* out0 = a.out + (tok0 * a.hq + t.kv * g + h) * d;
    for (int64_t c = 0; c < d; c += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(oh + (c + i) * kTQ), inv));
      transpose16x16_epi32(r);
      for (int64_t q = 0; q < t.nq; ++q)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out0 + q * a.hq * d + c),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(r[q])));
    }
  }
}

// One task on AMX: `nt` (1 or 2) consecutive 16-token tiles of one span and KV head, sharing
// each packed key block (the later tile sees more keys; a block a tile cannot see is skipped).
BATCHGEN_PREFILL_AMX_TARGET void run_tiles_amx(const Args<bf16_t>& a, const Task* tiles,
                                               int64_t nt, Scratch& s) {
  const int64_t g = a.hq / a.hkv, d = a.d, steps = d / 32;
  const int64_t per_tile = g * d * kTQ;
  s.qv.assign(nt * per_tile, 0);  // [tile][G][D / 2][16][2]
  s.ot.assign(nt * per_tile, 0.0f);
  s.m.assign(nt * g * kTQ, kInitMax);
  s.l.assign(nt * g * kTQ, 0.0f);
  s.kb.resize(kBK * d);
  s.vt.resize(d * kBK);
  s.pv.resize(kBK * kTQ + d);  // the P^T pairs, then a zero row of d elements
  s.s.resize(g * kBK * kTQ);  // S^T of every head, [G][32][16]
  bf16_t* zero_row = s.pv.data() + kBK * kTQ;
  std::fill(zero_row, zero_row + d, bf16_t(0));
  for (int64_t ti = 0; ti < nt; ++ti)
    for (int64_t h = 0; h < g; ++h)
      pack_q(a, tiles[ti], h, s.qv.data() + ti * per_tile + h * d * kTQ);
  amx_tile_config();
  // Word 2q of a P^T pair row is key 2kp at query q, word 2q + 1 key 2kp + 1.
  alignas(64) static constexpr int16_t kPairs[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                                     21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26,
                                                     11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i pairs = _mm512_load_si512(kPairs);
  const __m512 vscale = _mm512_set1_ps(a.scale), masked_v = _mm512_set1_ps(kMasked);
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i window = _mm512_set1_epi32(int(a.window));
  const bf16_t* vrows[kBK];
  const int64_t lo = tiles[0].lo, hi = tiles[nt - 1].hi;
  for (int64_t kb = lo; kb <= hi; kb += kBK) {
    const int64_t nk = std::min(kBK, hi + 1 - kb);
    bf16_t* kbuf = s.kb.data();
    for (int64_t k = 0; k < kBK; ++k) {
      if (k < nk) {
        std::memcpy(kbuf + k * d, cache_row(a.k_cache, a, tiles[0], kb + k), d * sizeof(bf16_t));
        vrows[k] = cache_row(a.v_cache, a, tiles[0], kb + k);
      } else {
        std::memset(kbuf + k * d, 0, d * sizeof(bf16_t));
        vrows[k] = zero_row;
      }
    }
    pack_vt(vrows, d, s.vt.data());
    for (int64_t ti = 0; ti < nt; ++ti) {
      const Task& t = tiles[ti];
      if (kb > t.hi || kb + nk - 1 < t.lo) continue;  // no key of the block visible to the tile
      const int64_t tnk = std::min(nk, t.hi + 1 - kb);  // keys past the tile's last are hidden
      const bool masked = block_needs_mask(t, a.window, kb, tnk);
      const __m512i pos = _mm512_add_epi32(_mm512_set1_epi32(int(t.p0)), lanes);
      const bf16_t* qv = s.qv.data() + ti * per_tile;
      for (int64_t h = 0; h + 1 < g; h += 2)
        scores2(kbuf, d, qv + h * d * kTQ, qv + (h + 1) * d * kTQ, s.s.data() + h * kBK * kTQ,
                s.s.data() + (h + 1) * kBK * kTQ);
      if (g % 2) scores1(kbuf, d, qv + (g - 1) * d * kTQ, s.s.data() + (g - 1) * kBK * kTQ);
      for (int64_t h = 0; h < g; ++h) {
        float* st = s.s.data() + h * kBK * kTQ;
        float* m = s.m.data() + (ti * g + h) * kTQ;
        float* l = s.l.data() + (ti * g + h) * kTQ;
        // Raw scores: the max commutes with the positive scale, folded into the exponent.
        const __m512 m_old = _mm512_loadu_ps(m);
        __m512 mx = m_old;
        // Keys past the tile's last: when they fill the block's second half, its exponentials
        // are skipped (zero weights).
        const int64_t live = tnk <= 16 ? 16 : kBK;
        for (int64_t k = 0; k < live; ++k) {
          __m512 x = _mm512_loadu_ps(st + k * kTQ);
          if (masked) {
            const __m512i j = _mm512_set1_epi32(int(kb + k));
            __mmask16 vis = k < tnk ? _mm512_cmple_epi32_mask(j, pos) : __mmask16(0);
            if (a.window > 0) vis &= _mm512_cmplt_epi32_mask(_mm512_sub_epi32(pos, j), window);
            x = _mm512_mask_mov_ps(masked_v, vis, x);
            _mm512_storeu_ps(st + k * kTQ, x);
          }
          mx = _mm512_max_ps(mx, x);
        }
        const __m512 mx_scaled = _mm512_mul_ps(mx, vscale);
        __m512 rsum = _mm512_setzero_ps();
        bf16_t* pv = s.pv.data();
        for (int64_t kp = live / 2; kp < kBK / 2; ++kp)
          _mm512_storeu_si512(pv + kp * 32, _mm512_setzero_si512());
        for (int64_t kp = 0; kp < live / 2; ++kp) {
          const __m512 s0 = _mm512_loadu_ps(st + 2 * kp * kTQ);
          const __m512 s1 = _mm512_loadu_ps(st + (2 * kp + 1) * kTQ);
          const __m512 p0 = exp_ps(_mm512_fmsub_ps(s0, vscale, mx_scaled));
          const __m512 p1 = exp_ps(_mm512_fmsub_ps(s1, vscale, mx_scaled));
          rsum = _mm512_add_ps(rsum, _mm512_add_ps(p0, p1));
          const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);  // [p0 x 16, p1 x 16]
          _mm512_storeu_si512(pv + kp * 32, _mm512_permutexvar_epi16(pairs, both));
        }
        float* ot = s.ot.data() + ti * per_tile + h * d * kTQ;
        // O and l rescale by e^(scale (m - m')) only where some lane's max grew (the running
        // max of a query rarely grows late in its keys).
        if (_mm512_cmp_ps_mask(mx, m_old, _CMP_GT_OQ)) {
          const __m512 alpha = exp_ps(_mm512_fmsub_ps(m_old, vscale, mx_scaled));
          _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), alpha, rsum));
          for (int64_t dd = 0; dd < d; ++dd)
            _mm512_storeu_ps(ot + dd * kTQ, _mm512_mul_ps(_mm512_loadu_ps(ot + dd * kTQ), alpha));
        } else {
          _mm512_storeu_ps(l, _mm512_add_ps(_mm512_loadu_ps(l), rsum));
        }
        _mm512_storeu_ps(m, mx);
        for (int64_t dt = 0; dt < d / 16; dt += 4)  // O^T, 4 x 16 dimensions at a time
          pv4(ot + dt * 16 * kTQ, s.vt.data() + dt * 16 * kBK, pv,
              std::min<int64_t>(4, d / 16 - dt));
      }
    }
  }
  _tile_release();
  for (int64_t ti = 0; ti < nt; ++ti)
    write_out_amx(a, tiles[ti], s.ot.data() + ti * per_tile, s.l.data() + ti * g * kTQ);
}
#else
inline bool amx_path_usable(int64_t) { return false; }
inline void run_tiles_amx(const Args<bf16_t>&, const Task*, int64_t, Scratch&) {}
#endif

}  // namespace
