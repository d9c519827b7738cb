// The AVX512-BF16 path of the bf16 paged decode attention kernel (paged_decode_attention.cpp
// includes this after its Args and store helpers): `vdpbf16ps` for Q @ K^T and P @ V, a vector
// exp, and the work of one (sequence, KV head) with the G query heads that share it.
//
// Per (sequence, KV head), positions [start, len) as n rows, padded to a multiple of 16 with
// the row of the first position (finite values: their weights are zero):
//   scores  per query head, 16 positions at a time: 16 accumulators of `vdpbf16ps(k row,
//           q)` over D / 32 chunks (the K rows, 16 x D bf16, stay in L1 across the G heads),
//           then one 16 -> 1 transpose-add tree (`reduce16`: 45 shuffles and adds for 16 dot
//           products) whose result lane i is position i; times the scale. Or, where AMX-BF16
//           is usable and blocks are a multiple of 16 slots (`AmxScores`), one `tdpbf16ps` per
//           32 dimensions for 16 positions x the G heads at once (isa "amx", auto's choice).
//   softmax per query head in float32: max, `exp_ps`, the sum of the float32 exponentials,
//           the weights rounded to bf16 (`vcvtneps2bf16`, round to nearest even) into the
//           layout P @ V reads: consecutive positions' weights are adjacent, so one 32-bit
//           word is the pair (w_j, w_j+1).
//   P @ V   two value rows j, j+1 interleaved per element (`vpunpck[lh]wd`: a word pair per
//           dimension, the lanes permuted within 128 bits), one `vdpbf16ps` per query head
//           against the broadcast weight pair: a KV head's up to 4 query heads x 64
//           dimensions of float32 accumulators (16 zmm) stay in registers; more heads or
//           dimensions take further passes over the rows. The lanes are put back in order,
//           scaled by 1 / sum and rounded to bf16 once at the end. With AMX scores, P @ V
//           is AMX's too (`AmxPV`: the same interleaved pairs stored as B tiles, the weights
//           as tile A, `tdpbf16ps`; 32 positions a step, so the weights and rows are padded
//           to a multiple of 32).
// Numerics (the contract of paged_decode_attention.cpp): bf16 x bf16 products are exact in
// float32 and summed in float32 (another order than the AVX-512F path: pairs of dimensions,
// then the tree, or AMX's fixed order within 32 dimensions; for P @ V, pairs of positions, or
// AMX's order within 32 positions).
// Measured (benchmarks/paged_attention.py, bench shapes, 1 thread, loaded machine): in L2/L3
// 4x the AVX-512F path with AMX scores, 3.3x with vdpbf16ps scores; from memory 2-2.4x and
// 1.9x: there both paths wait on the cache misses one core keeps in flight (perf: the stalls
// sit on the prefetches of the next block's rows). vdpbf16ps and vcvtneps2bf16 treat subnormal
// inputs as zero and flush subnormal results (a weight below 2^-126 becomes 0: an error below
// 2^-126 |v|).
#pragma once

#include "attention_exp.h"  // BATCHGEN_ATTN_BF16_TARGET, avx512_bf16_usable, exp_ps
#include "fused_moe_common.h"

namespace {

#if BATCHGEN_HAVE_BF16
// Slot s of `reduce16` ends in lane kTreeLane[s] (an involution: slot kTreeLane[i] ends in
// lane i), so position i accumulates in slot kTreeLane[i].
constexpr int kTreeLane[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

// The 16 lane sums of v[0..15], lane kTreeLane[s] holding the sum of v[s].
BATCHGEN_ATTN_BF16_TARGET inline __m512 reduce16(__m512* v) {
  __m512 w[8], u[4], z[2];
  for (int p = 0; p < 8; ++p)  // halves: lanes 0-7 slot p, 8-15 slot p + 8
    w[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[p], v[p + 8], 0x44),
                         _mm512_shuffle_f32x4(v[p], v[p + 8], 0xEE));
  for (int p = 0; p < 4; ++p)  // quarters: slots p, p + 8, p + 4, p + 12
    u[p] = _mm512_add_ps(_mm512_shuffle_f32x4(w[p], w[p + 4], 0x88),
                         _mm512_shuffle_f32x4(w[p], w[p + 4], 0xDD));
  for (int p = 0; p < 2; ++p)  // per 128 bits: two lanes of u[p]'s slot, two of u[p + 2]'s
    z[p] = _mm512_add_ps(_mm512_shuffle_ps(u[p], u[p + 2], 0x44),
                         _mm512_shuffle_ps(u[p], u[p + 2], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
}

// Prefetch whole rows (row_bytes, every KV head) j0 .. j0 + 15 of `rows` into cache `Hint`.
template <int Hint>
inline void prefetch_rows(const bf16_t* const* rows, int64_t j0, int64_t n16, int64_t row_bytes) {
  if (j0 >= n16) return;
  for (int p = 0; p < 16; ++p) {
    const char* r = reinterpret_cast<const char*>(rows[j0 + p]);
    for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(r + off, 0, Hint);
  }
}

// The AMX path's prefetch distances (paged_decode_attention_amx.h): whole K rows
// kPrefetchAhead chunks of 16 ahead to L1, the V rows of a chunk to L2 during the scores.
constexpr int64_t kPrefetchAhead = 2;
// Value rows prefetched to L1 ahead of P @ V (AMX path; measured on the vdpbf16ps path on an
// Intel AMX machine). The rows' L2 prefetch during the scores does not
// keep them there in time: perf put 45% of the stalls on the value loads; from memory (1
// thread, 4 caches of 13.5 MB cycled) this took P @ V + scores from 2.7 to 2.0 ms (16 rows:
// 2.2, 64: 2.1).
constexpr int64_t kValueAhead = 32;
// The vdpbf16ps path's distances (the AMX path keeps the two above): whole K rows kVecKAhead
// chunks ahead and value rows kVecVAhead positions ahead, both into L2 (`prefetcht1`), the
// value rows only during the P @ V of the KV head that reads them (the first kVecVAhead
// during its last head's softmax). On AMD Zen 4 (no AMX;
// benchmarks/peers/decode_attention.py shapes, 1 thread, from memory) 0.85-0.9x the time of the
// AMX path's distances and L1 hints with the value rows prefetched during the scores.
constexpr int64_t kVecKAhead = 4;
constexpr int64_t kVecVAhead = 64;
// The next sequence's whole K and V rows (`rows`, K's first), prefetched into L2 a few at a
// time (`step`, `rate` rows a step on average) during the current sequence's last KV head,
// whose passes read the current rows from L2: the next sequence's first pass then finds its
// rows in cache instead of waiting on memory with no work to overlap.
struct NextRows {
  std::vector<const bf16_t*> rows;
  int64_t done = 0, row_bytes = 0;
  float due = 0.0f, rate = 0.0f;
  inline void step() {
    due += rate;
    const int64_t end = std::min<int64_t>(int64_t(due), int64_t(rows.size()));
    for (; done < end; ++done)
      for (int64_t off = 0; off < row_bytes; off += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(rows[done]) + off, 0, 2);
  }
};

// s[j] = scale * <q, k_rows[j][off : off + d]> for j < n16 (a multiple of 16); d % 32 == 0.
// With `prefetch` (the first head of the first KV head: the rows are not in cache yet), whole
// K rows `kVecKAhead` chunks of 16 ahead go to L2 (the rows of a sequence sit in blocks
// anywhere in the cache: the hardware prefetcher follows a block's rows but cannot guess the
// next block).
BATCHGEN_ATTN_BF16_TARGET inline void scores_bf16(const bf16_t* q, const bf16_t* const* k_rows,
                                                  int64_t off, int64_t d, int64_t n16,
                                                  float scale, float* s, bool prefetch,
                                                  int64_t row_bytes, NextRows* ahead) {
  const __m512 vscale = _mm512_set1_ps(scale);
  if (prefetch)
    for (int64_t a = 0; a < kVecKAhead; ++a) prefetch_rows<2>(k_rows, 16 * a, n16, row_bytes);
  for (int64_t j0 = 0; j0 < n16; j0 += 16) {
    if (prefetch) prefetch_rows<2>(k_rows, j0 + 16 * kVecKAhead, n16, row_bytes);
    if (ahead != nullptr) ahead->step();
    __m512 acc[16];
    for (int p = 0; p < 16; ++p) acc[p] = _mm512_setzero_ps();
    const bf16_t* const* rows = k_rows + j0;
    for (int64_t c = 0; c < d; c += 32) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + c);
      for (int p = 0; p < 16; ++p)
        acc[kTreeLane[p]] = _mm512_dpbf16_ps(
            acc[kTreeLane[p]], (__m512bh)_mm512_loadu_si512(rows[p] + off + c), qv);
    }
    _mm512_storeu_ps(s + j0, _mm512_mul_ps(reduce16(acc), vscale));
  }
}

}  // namespace
#include "paged_decode_attention_amx.h"
namespace {

// Softmax of s[0..n) (s readable to n16, a multiple of 16 that may exceed n by more than 16):
// the unnormalised weights rounded to bf16 into w[0..n16) (zero past n); returns 1 / the sum
// of the float32 exponentials.
BATCHGEN_ATTN_BF16_TARGET inline float softmax_bf16(const float* s, int64_t n, int64_t n16,
                                                    bf16_t* w) {
  const __m512 lowest = _mm512_set1_ps(-3.0e38f);
  __m512 mx = lowest;
  for (int64_t j = 0; j < n16; j += 16) {
    const __mmask16 live = n - j >= 16 ? __mmask16(0xFFFF)
                           : n - j <= 0 ? __mmask16(0)
                                        : __mmask16((1u << (n - j)) - 1);
    mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(lowest, live, s + j));
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n16; j += 16) {
    const __mmask16 live = n - j >= 16 ? __mmask16(0xFFFF)
                           : n - j <= 0 ? __mmask16(0)
                                        : __mmask16((1u << (n - j)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(live, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + j), m)));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + j), (__m256i)_mm512_cvtneps_pbh(e));
  }
  return 1.0f / _mm512_reduce_add_ps(sum);
}


// out[i][c0 : c0 + 32 NC] = round_bf16(inv_sum[i] * sum_j w[i][j] v_rows[j][off + c0 : ...])
// for GB query heads i: w[i] = w0 + i * w_stride (bf16, n2 of them, n2 even), out[i] = out0 +
// i * d.
template <int GB, int NC>
BATCHGEN_ATTN_BF16_TARGET void pv_bf16(const bf16_t* w0, int64_t w_stride,
                                       const bf16_t* const* v_rows, int64_t off, int64_t n2,
                                       const float* inv_sum, bf16_t* out0, int64_t d,
                                       NextRows* ahead) {
  __m512 acc[GB][2 * NC];
  for (int i = 0; i < GB; ++i)
    for (int c = 0; c < 2 * NC; ++c) acc[i][c] = _mm512_setzero_ps();
  const uint32_t* w32[GB];
  for (int i = 0; i < GB; ++i) w32[i] = reinterpret_cast<const uint32_t*>(w0 + i * w_stride);
  for (int64_t j = 0; j < n2; j += 2) {
    const bf16_t* r0 = v_rows[j] + off;
    const bf16_t* r1 = v_rows[j + 1] + off;
    if (j + kVecVAhead < n2)
      for (int r = 0; r < 2; ++r)
        for (int c = 0; c < NC; ++c)
          __builtin_prefetch(v_rows[j + kVecVAhead + r] + off + 32 * c, 0, 2);
    if (ahead != nullptr && j % 16 == 0) ahead->step();
    __m512bh lo[NC], hi[NC];
    for (int c = 0; c < NC; ++c) {
      const __m512i a = _mm512_loadu_si512(r0 + 32 * c), b = _mm512_loadu_si512(r1 + 32 * c);
      lo[c] = (__m512bh)_mm512_unpacklo_epi16(a, b);  // dims 8L + 0..3 of each 128-bit lane L
      hi[c] = (__m512bh)_mm512_unpackhi_epi16(a, b);  // dims 8L + 4..7
    }
    for (int i = 0; i < GB; ++i) {
      const __m512bh wp = (__m512bh)_mm512_set1_epi32(int(w32[i][j / 2]));
      for (int c = 0; c < NC; ++c) {
        acc[i][2 * c] = _mm512_dpbf16_ps(acc[i][2 * c], lo[c], wp);
        acc[i][2 * c + 1] = _mm512_dpbf16_ps(acc[i][2 * c + 1], hi[c], wp);
      }
    }
  }
  // Dimension t of a 32-dim chunk: lane 4 (t / 8) + t % 4 of lo (t % 8 < 4) or of hi (+16).
  alignas(64) static constexpr int32_t kFirst[16] = {0, 1, 2, 3, 16, 17, 18, 19,
                                                     4, 5, 6, 7, 20, 21, 22, 23};
  alignas(64) static constexpr int32_t kSecond[16] = {8,  9,  10, 11, 24, 25, 26, 27,
                                                      12, 13, 14, 15, 28, 29, 30, 31};
  const __m512i first = _mm512_load_si512(kFirst), second = _mm512_load_si512(kSecond);
  for (int i = 0; i < GB; ++i) {
    const __m512 sc = _mm512_set1_ps(inv_sum[i]);
    for (int c = 0; c < NC; ++c) {
      const __m512 x0 = _mm512_permutex2var_ps(acc[i][2 * c], first, acc[i][2 * c + 1]);
      const __m512 x1 = _mm512_permutex2var_ps(acc[i][2 * c], second, acc[i][2 * c + 1]);
      const __m512bh y = _mm512_cvtne2ps_pbh(_mm512_mul_ps(x1, sc), _mm512_mul_ps(x0, sc));
      _mm512_storeu_si512(out0 + i * d + 32 * c, (__m512i)y);
    }
  }
}

template <int GB>
void pv_bf16_dims(const bf16_t* w0, int64_t w_stride, const bf16_t* const* v_rows, int64_t off,
                  int64_t n2, const float* inv_sum, bf16_t* out0, int64_t d, NextRows* ahead) {
  for (int64_t c0 = 0; c0 < d; c0 += 64) {
    if (d - c0 >= 64)
      pv_bf16<GB, 2>(w0, w_stride, v_rows, off + c0, n2, inv_sum, out0 + c0, d, ahead);
    else
      pv_bf16<GB, 1>(w0, w_stride, v_rows, off + c0, n2, inv_sum, out0 + c0, d, ahead);
  }
}

// Per-thread buffers of the AVX512-BF16 path.
struct Bf16Scratch {
  std::vector<const bf16_t*> k_rows, v_rows;  // [n16]: slot rows (all KV heads)
  std::vector<const bf16_t*> chunk_rows;      // AMX: K row of each 16-aligned chunk
  std::vector<float> scores, inv_sum;         // [G, n16 + 16], [G]
  std::vector<bf16_t> weights;                // [G, n16]
  std::vector<uint32_t> qpairs;               // AMX: [D / 32][16][G]
  NextRows next;                              // the next sequence's rows (vdpbf16ps path)
  alignas(64) float cbuf[4 * 16 * 16];        // AMX: tiles C
  alignas(64) bf16_t vbuf[4 * 512];           // AMX P @ V: tiles B
};

// rows[j] = cache row of position start + j (all KV heads: row elements), j < n: one division
// per block.
inline void slot_rows(const bf16_t* cache, const int64_t* table, int64_t block_size,
                      int64_t row, int64_t start, int64_t n, const bf16_t** rows) {
  for (int64_t j = 0, p = start; j < n;) {
    const int64_t in_block = p % block_size;
    const bf16_t* base = cache + (table[p / block_size] * block_size + in_block) * row;
    const int64_t count = std::min(block_size - in_block, n - j);
    for (int64_t i = 0; i < count; ++i) rows[j + i] = base + i * row;
    j += count;
    p += count;
  }
}

// The sequence b on the AVX512-BF16 path; a.d % 32 == 0. `amx`: the scores and P @ V by AMX
// (AmxTiles::usable; the calling thread has run AmxTiles::configure).
// `next`: the sequence this thread probably runs next (-1: none), whose rows the last KV head's
// passes prefetch (NextRows).
inline void run_seq_bf16(const Args<bf16_t>& a, int64_t b, Bf16Scratch& s, bool amx,
                         int64_t next) {
  const int64_t len = a.kv_lens[b], d = a.d, g = a.hq / a.hkv, row = a.hkv * d;
  const int64_t start = a.sliding_window > 0 ? std::max<int64_t>(0, len - a.sliding_window) : 0;
  const int64_t n = len - start;
  bf16_t* out = a.out + b * a.hq * d;
  if (n <= 0) {
    std::fill(out, out + a.hq * d, bf16_t(0));
    return;
  }
  // n16: positions padded for the scores; AMX's P @ V takes 32 at a time (w_len).
  const int64_t n16 = (n + 15) / 16 * 16, n2 = (n + 1) / 2 * 2;
  const int64_t w_len = amx ? (n + 31) / 32 * 32 : n16;
  // AMX: chunks of 16 positions from the 16-aligned a0 <= start (rows before start and past
  // len are in the same blocks: read, then dropped); scores of position start + j at j + lead.
  const int64_t lead = amx ? start % 16 : 0;
  const int64_t num_chunks = (n + lead + 15) / 16;
  const int64_t s_stride = w_len + 32;
  const int64_t* table = a.block_tables + b * a.max_blocks;
  // v_rows: read up to w_len by P @ V and 16 num_chunks by the AMX scores' prefetches.
  const int64_t v_len = std::max(w_len, amx ? 16 * num_chunks : n16);
  s.k_rows.resize(n16);
  s.v_rows.resize(v_len);
  slot_rows(a.v_cache, table, a.block_size, row, start, n, s.v_rows.data());
  for (int64_t j = n; j < v_len; ++j) s.v_rows[j] = s.v_rows[0];  // finite rows, weight zero
  if (amx) {
    s.chunk_rows.resize(num_chunks);
    for (int64_t c = 0; c < num_chunks; ++c) {
      const int64_t p = start - lead + 16 * c;
      s.chunk_rows[c] =
          a.k_cache + (table[p / a.block_size] * a.block_size + p % a.block_size) * row;
    }
    s.qpairs.resize(d / 2 * g);
  } else {
    slot_rows(a.k_cache, table, a.block_size, row, start, n, s.k_rows.data());
    for (int64_t j = n; j < n16; ++j) s.k_rows[j] = s.k_rows[0];
  }
  s.scores.resize(g * s_stride);
  s.weights.resize(g * w_len);
  s.inv_sum.resize(g);
  NextRows* ahead = nullptr;
  for (int64_t kv = 0; kv < a.hkv; ++kv) {
    const bf16_t* q = a.q + b * a.q_stride + kv * g * d;
    if (!amx && kv == a.hkv - 1 && next >= 0) {
      // The next sequence's K rows, then its V rows, over this KV head's steps: g score passes
      // of n16 / 16 chunks and P @ V passes (per 4 heads, per 64 dimensions) of n2 / 16 steps.
      const int64_t nlen = a.kv_lens[next];
      const int64_t nstart =
          a.sliding_window > 0 ? std::max<int64_t>(0, nlen - a.sliding_window) : 0;
      const int64_t nn = std::max<int64_t>(0, nlen - nstart);
      NextRows& nr = s.next;
      nr.rows.resize(2 * nn);
      const int64_t* ntable = a.block_tables + next * a.max_blocks;
      slot_rows(a.k_cache, ntable, a.block_size, row, nstart, nn, nr.rows.data());
      slot_rows(a.v_cache, ntable, a.block_size, row, nstart, nn, nr.rows.data() + nn);
      const int64_t steps = g * (n16 / 16) + (g + 3) / 4 * ((d + 63) / 64) * ((n2 + 15) / 16);
      nr.done = 0;
      nr.due = 0.0f;
      nr.rate = float(2 * nn) / float(std::max<int64_t>(1, steps));
      nr.row_bytes = row * int64_t(sizeof(bf16_t));
      ahead = &nr;
    }
    if (amx) {
#if BATCHGEN_HAVE_AMX
      // qpairs[k][i][h] = q_h's dimensions 32 k + 2 i, 32 k + 2 i + 1 (one word).
      for (int64_t h = 0; h < g; ++h) {
        const uint32_t* qh = reinterpret_cast<const uint32_t*>(q + h * d);
        for (int64_t i = 0; i < d / 2; ++i) s.qpairs[i * g + h] = qh[i];
      }
      AmxScores::scores(s.chunk_rows.data(), int64_t(s.chunk_rows.size()), kv * d, d, g,
                        row * int64_t(sizeof(bf16_t)), s.qpairs.data(), a.scale,
                        s.scores.data(), s_stride, s.cbuf, kv == 0 ? s.v_rows.data() : nullptr);
#endif
    }
    for (int64_t h = 0; h < g; ++h) {
      float* sh = s.scores.data() + h * s_stride;
      if (!amx) {
        scores_bf16(q + h * d, s.k_rows.data(), kv * d, d, n16, a.scale, sh, kv == 0 && h == 0,
                    row * int64_t(sizeof(bf16_t)), ahead);
        if (h == g - 1)  // P @ V's first value rows (this KV head's part) into L2
          for (int64_t j = 0; j < std::min(n, kVecVAhead); ++j)
            for (int64_t c = 0; c < d; c += 32) __builtin_prefetch(s.v_rows[j] + kv * d + c, 0, 2);
      }
      s.inv_sum[h] = softmax_bf16(sh + lead, n, w_len, s.weights.data() + h * w_len);
    }
    bf16_t* o = out + kv * g * d;
    if (amx) {
#if BATCHGEN_HAVE_AMX
      AmxPV::pv(s.weights.data(), w_len, g, s.v_rows.data(), kv * d, w_len, s.inv_sum.data(), o,
                d, s.vbuf, s.cbuf);
#endif
      continue;
    }
    for (int64_t h = 0; h < g; h += 4) {
      const bf16_t* w = s.weights.data() + h * w_len;
      const float* inv = s.inv_sum.data() + h;
      const bf16_t* const* v = s.v_rows.data();
      switch (std::min<int64_t>(4, g - h)) {
        case 1: pv_bf16_dims<1>(w, w_len, v, kv * d, n2, inv, o + h * d, d, ahead); break;
        case 2: pv_bf16_dims<2>(w, w_len, v, kv * d, n2, inv, o + h * d, d, ahead); break;
        case 3: pv_bf16_dims<3>(w, w_len, v, kv * d, n2, inv, o + h * d, d, ahead); break;
        default: pv_bf16_dims<4>(w, w_len, v, kv * d, n2, inv, o + h * d, d, ahead); break;
      }
    }
  }
}
#else
}  // namespace
#include "paged_decode_attention_amx.h"  // its stub: AMX scores never usable
namespace {
inline bool avx512_bf16_usable() { return false; }
struct Bf16Scratch {};
inline void run_seq_bf16(const Args<bf16_t>&, int64_t, Bf16Scratch&, bool, int64_t) {}
#endif

}  // namespace
