// The AMX-BF16 scores of the bf16 paged decode attention kernel's AVX512-BF16 path
// (paged_decode_attention_bf16.h includes this after `prefetch_rows`, `kPrefetchAhead` and
// `kValueAhead`).
// Tile configuration and the OS permission come from the fused MoE kernel's AMX header.
#pragma once

#include "fused_moe_amx.h"  // amx_usable, AmxTileConfig, BATCHGEN_AMX_TARGET
#include "fused_moe_common.h"

namespace {

#if BATCHGEN_HAVE_AMX && BATCHGEN_HAVE_BF16
// One tile configuration serves the scores and P @ V of every sequence a thread runs (loaded
// once per call and thread: `ldtilecfg` and `tilerelease` per sequence and KV head cost about
// as much as attending to a short context):
//   tmm0  scores C   16 positions x G heads, float32      (16 rows of 4 G bytes)
//   tmm1  scores B   32 dimensions of q as 16 pairs x G    (16 rows of 4 G bytes)
//   tmm2  scores A   16 key rows x 32 dimensions; P @ V B  (16 rows of 64 bytes)
//   tmm3  P @ V A    G heads x 32 positions of weights     (G rows of 64 bytes)
//   tmm4-7 P @ V C   G heads x 16 dimensions, float32      (G rows of 64 bytes)
struct AmxTiles {
  static bool usable(int64_t d, int64_t g, int64_t block_size) {
    return d % 32 == 0 && d <= 32 * 6 && g <= 16 && block_size % 16 == 0 && amx_usable();
  }

  BATCHGEN_AMX_TARGET static void configure(int64_t g) {
    AmxTileConfig cfg;
    std::memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
      cfg.rows[t] = uint8_t(t >= 3 ? g : 16);
      cfg.colsb[t] = uint16_t(t <= 1 ? 4 * g : 64);
    }
    _tile_loadconfig(&cfg);
  }

  BATCHGEN_AMX_TARGET static void release() { _tile_release(); }
};

// The AMX variant of the scores (`tdpbf16ps`), for blocks of a multiple of 16 slots: 16
// positions p0 .. p0 + 15 with p0 a multiple of 16 lie in one block at a constant stride, so
// tile A is 16 key rows x 32 dimensions loaded straight from the cache (`tileloadd`, stride =
// one slot's row); tile B is the G query heads' 32 dimensions as 16 pairs x G (the VNNI
// layout, `qpairs`, built once per sequence and KV head, loaded from L1 each step); tile C
// (16 positions x G heads, float32) sums the D / 32 steps. C's columns (one per head) are
// gathered into each head's score row. Tiles as `AmxTiles` configures them.
struct AmxScores {
  // s[h * s_stride + j] = scale * <q_h, K row of position a0 + j> for chunks of 16 positions
  // from the 16-aligned a0: chunk c's rows at chunk_rows[c] + off, stride_bytes apart.
  // qpairs: [D / 32][16][G] words (pairs of q's dimensions); cbuf: 16 x G floats.
  BATCHGEN_AMX_TARGET static void scores(const bf16_t* const* chunk_rows, int64_t num_chunks,
                                         int64_t off, int64_t d, int64_t g, int64_t stride_bytes,
                                         const uint32_t* qpairs, float scale, float* s,
                                         int64_t s_stride, float* cbuf,
                                         const bf16_t* const* v_rows) {
    const int64_t steps = d / 32;
    const __m512 vscale = _mm512_set1_ps(scale);
    // G = 4: cbuf as 4 vectors of 4 keys x 4 heads; lane i of z_a (a = 0, 1) is key 4 a + i / 4,
    // head i % 4 (index 16 a + i in permutex2var's pair).
    const __m512i kHeads01 = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28,
                                               1, 5, 9, 13, 17, 21, 25, 29);
    const __m512i kHeads23 = _mm512_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30,
                                               3, 7, 11, 15, 19, 23, 27, 31);
    const __m512i kLow = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7,
                                           16, 17, 18, 19, 20, 21, 22, 23);
    const __m512i kHigh = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15,
                                            24, 25, 26, 27, 28, 29, 30, 31);
    const __m512i lane = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(int(g)));
    // v_rows (the first KV head): prefetch K chunks kPrefetchAhead ahead (16 contiguous rows,
    // every KV head) to L1 and this chunk's V rows to L2, as `scores_bf16` does.
    const int64_t n16 = 16 * num_chunks;
    if (v_rows != nullptr)
      for (int64_t c = 0; c < std::min(kPrefetchAhead, num_chunks); ++c)
        for (int64_t o = 0; o < 16 * stride_bytes; o += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(chunk_rows[c]) + o, 0, 3);
    for (int64_t c = 0; c < num_chunks; ++c) {
      if (v_rows != nullptr) {
        if (c + kPrefetchAhead < num_chunks)
          for (int64_t o = 0; o < 16 * stride_bytes; o += 64)
            __builtin_prefetch(reinterpret_cast<const char*>(chunk_rows[c + kPrefetchAhead]) + o,
                               0, 3);
        prefetch_rows<2>(v_rows, 16 * c, n16, stride_bytes);
      }
      const bf16_t* a = chunk_rows[c] + off;
      _tile_zero(0);
      for (int64_t k = 0; k < steps; ++k) {
        _tile_loadd(2, a + 32 * k, stride_bytes);
        _tile_loadd(1, qpairs + k * 16 * g, 4 * g);
        _tile_dpbf16ps(0, 2, 1);
      }
      _tile_stored(0, cbuf, 4 * g);
      if (g == 4) {  // 16 x 4 -> 4 x 16 by two rounds of permutes, not 4 gathers
        const __m512 z0 = _mm512_load_ps(cbuf), z1 = _mm512_load_ps(cbuf + 16);
        const __m512 z2 = _mm512_load_ps(cbuf + 32), z3 = _mm512_load_ps(cbuf + 48);
        const __m512 t0 = _mm512_permutex2var_ps(z0, kHeads01, z1);  // h0 k0-7, h1 k0-7
        const __m512 t1 = _mm512_permutex2var_ps(z0, kHeads23, z1);  // h2 k0-7, h3 k0-7
        const __m512 t2 = _mm512_permutex2var_ps(z2, kHeads01, z3);  // h0 k8-15, h1 k8-15
        const __m512 t3 = _mm512_permutex2var_ps(z2, kHeads23, z3);  // h2 k8-15, h3 k8-15
        float* o = s + 16 * c;
        _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_permutex2var_ps(t0, kLow, t2), vscale));
        _mm512_storeu_ps(o + s_stride,
                         _mm512_mul_ps(_mm512_permutex2var_ps(t0, kHigh, t2), vscale));
        _mm512_storeu_ps(o + 2 * s_stride,
                         _mm512_mul_ps(_mm512_permutex2var_ps(t1, kLow, t3), vscale));
        _mm512_storeu_ps(o + 3 * s_stride,
                         _mm512_mul_ps(_mm512_permutex2var_ps(t1, kHigh, t3), vscale));
        continue;
      }
      for (int64_t h = 0; h < g; ++h)
        _mm512_storeu_ps(s + h * s_stride + 16 * c,
                         _mm512_mul_ps(_mm512_i32gather_ps(lane, cbuf + h, 4), vscale));
    }
  }
};

// P @ V by AMX-BF16 for the G query heads of one KV head (G <= 16, D % 32 == 0):
//   out[h][:] = round_bf16(inv_sum[h] * sum_j w[h][j] v_rows[j][off : off + D]).
// tile A = the G heads' bf16 weights of 32 positions (row h: w[h][k0 .. k0 + 31], adjacent
// positions paired as tdpbf16ps wants); tile B = 16 position pairs x 16 dimensions, each row two
// value rows interleaved per dimension (VNNI), built per 32 positions from the cache rows in L1
// (`vpunpck[lh]wd`: dimension order permuted within 128 bits, undone at the end as `pv_bf16`
// does); tiles C (G x 16 float32) sum over all positions, 64 dimensions a pass. Against
// `pv_bf16` (16 vdpbf16ps per position pair for 4 heads x 64 dimensions) this spends 4
// interleaves and 4 stores per pair and 4 tdpbf16ps of G rows per 32 positions. Tiles as
// `AmxTiles` configures them.
struct AmxPV {
  // w: [G][w_stride] bf16 weights, zero from n to n32 (a multiple of 32); v_rows[j] (j < n32,
  // finite rows past n) + off: the KV head's D values of position j; vbuf: 4 x 512 bf16
  // (64-byte aligned); cbuf: 4 x 16 x 16 floats.
  BATCHGEN_AMX_TARGET static void pv(const bf16_t* w, int64_t w_stride, int64_t g,
                                     const bf16_t* const* v_rows, int64_t off, int64_t n32,
                                     const float* inv_sum, bf16_t* out, int64_t d,
                                     bf16_t* vbuf, float* cbuf) {
    alignas(64) static constexpr int32_t kFirst[16] = {0, 1, 2, 3, 16, 17, 18, 19,
                                                       4, 5, 6, 7, 20, 21, 22, 23};
    alignas(64) static constexpr int32_t kSecond[16] = {8,  9,  10, 11, 24, 25, 26, 27,
                                                        12, 13, 14, 15, 28, 29, 30, 31};
    const __m512i first = _mm512_load_si512(kFirst), second = _mm512_load_si512(kSecond);
    for (int64_t c0 = 0; c0 < d; c0 += 64) {
      const int64_t halves = std::min<int64_t>(2, (d - c0) / 32);  // 32-dim chunks this pass
      _tile_zero(4);
      _tile_zero(5);
      if (halves > 1) { _tile_zero(6); _tile_zero(7); }
      for (int64_t k0 = 0; k0 < n32; k0 += 32) {
        for (int64_t r = 0; r < 16; ++r) {
          const int64_t j = k0 + 2 * r;
          if (j + kValueAhead < n32)
            for (int64_t c = 0; c < halves; ++c) {
              __builtin_prefetch(v_rows[j + kValueAhead] + off + c0 + 32 * c, 0, 3);
              __builtin_prefetch(v_rows[j + kValueAhead + 1] + off + c0 + 32 * c, 0, 3);
            }
          for (int64_t c = 0; c < halves; ++c) {
            const __m512i a = _mm512_loadu_si512(v_rows[j] + off + c0 + 32 * c);
            const __m512i b = _mm512_loadu_si512(v_rows[j + 1] + off + c0 + 32 * c);
            _mm512_store_si512(vbuf + (2 * c) * 512 + 32 * r, _mm512_unpacklo_epi16(a, b));
            _mm512_store_si512(vbuf + (2 * c + 1) * 512 + 32 * r, _mm512_unpackhi_epi16(a, b));
          }
        }
        _tile_loadd(3, w + k0, w_stride * int64_t(sizeof(bf16_t)));
        _tile_loadd(2, vbuf, 64);
        _tile_dpbf16ps(4, 3, 2);
        _tile_loadd(2, vbuf + 512, 64);
        _tile_dpbf16ps(5, 3, 2);
        if (halves > 1) {
          _tile_loadd(2, vbuf + 1024, 64);
          _tile_dpbf16ps(6, 3, 2);
          _tile_loadd(2, vbuf + 1536, 64);
          _tile_dpbf16ps(7, 3, 2);
        }
      }
      _tile_stored(4, cbuf, 64);
      _tile_stored(5, cbuf + 256, 64);
      if (halves > 1) {
        _tile_stored(6, cbuf + 512, 64);
        _tile_stored(7, cbuf + 768, 64);
      }
      for (int64_t h = 0; h < g; ++h) {
        const __m512 sc = _mm512_set1_ps(inv_sum[h]);
        for (int64_t c = 0; c < halves; ++c) {
          const __m512 lo = _mm512_load_ps(cbuf + (2 * c) * 256 + 16 * h);
          const __m512 hi = _mm512_load_ps(cbuf + (2 * c + 1) * 256 + 16 * h);
          const __m512 x0 = _mm512_permutex2var_ps(lo, first, hi);
          const __m512 x1 = _mm512_permutex2var_ps(lo, second, hi);
          const __m512bh y = _mm512_cvtne2ps_pbh(_mm512_mul_ps(x1, sc), _mm512_mul_ps(x0, sc));
          _mm512_storeu_si512(out + h * d + c0 + 32 * c, (__m512i)y);
        }
      }
    }
  }
};
#else
struct AmxTiles {
  static bool usable(int64_t, int64_t, int64_t) { return false; }
  static void configure(int64_t) {}
  static void release() {}
};
#endif

}  // namespace
