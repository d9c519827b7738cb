// The AMX-BF16 scores of the bf16 paged decode attention kernel's AVX512-BF16 path
// (paged_decode_attention_bf16.h includes this after `prefetch_rows` and `kPrefetchAhead`).
// Tile configuration and the OS permission come from the fused MoE kernel's AMX header.
#pragma once

#include "fused_moe_amx.h"  // amx_usable, AmxTileConfig, BATCHGEN_AMX_TARGET
#include "fused_moe_common.h"

namespace {

#if BATCHGEN_HAVE_AMX && BATCHGEN_HAVE_BF16
// The AMX variant of the scores (`tdpbf16ps`), for blocks of a multiple of 16 slots: 16
// positions p0 .. p0 + 15 with p0 a multiple of 16 lie in one block at a constant stride, so
// tile A is 16 key rows x 32 dimensions loaded straight from the cache (`tileloadd`, stride =
// one slot's row); tile B is the G query heads' 32 dimensions as 16 pairs x G (the VNNI
// layout, `qpairs`, built once per sequence and KV head and kept in tiles 2 ..); tile C (16
// positions x G heads, float32) sums the D / 32 steps. C's columns (one per head) are gathered
// into each head's score row. Tiles: C = tmm0, A = tmm1, B = tmm2 .. tmm(1 + D / 32).
struct AmxScores {
  static bool usable(int64_t d, int64_t g, int64_t block_size) {
    return d % 32 == 0 && d <= 32 * 6 && g <= 16 && block_size % 16 == 0 && amx_usable();
  }

  BATCHGEN_AMX_TARGET static void configure(int64_t d, int64_t g) {
    AmxTileConfig cfg;
    std::memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int t = 0; t < 2 + d / 32; ++t) {
      cfg.rows[t] = 16;
      cfg.colsb[t] = t == 1 ? 64 : uint16_t(4 * g);
    }
    _tile_loadconfig(&cfg);
  }

  // s[h * s_stride + j] = scale * <q_h, K row of position a0 + j> for chunks of 16 positions
  // from the 16-aligned a0: chunk c's rows at chunk_rows[c] + off, stride_bytes apart.
  // qpairs: [D / 32][16][G] words (pairs of q's dimensions); cbuf: 16 x G floats.
  BATCHGEN_AMX_TARGET static void scores(const bf16_t* const* chunk_rows, int64_t num_chunks,
                                         int64_t off, int64_t d, int64_t g, int64_t stride_bytes,
                                         const uint32_t* qpairs, float scale, float* s,
                                         int64_t s_stride, float* cbuf,
                                         const bf16_t* const* v_rows) {
    configure(d, g);
    const int steps = int(d / 32);
    // The B tiles: tile 2 + k holds step k (tile numbers are immediates: unrolled).
    if (steps > 0) _tile_loadd(2, qpairs + 0 * 16 * g, 4 * g);
    if (steps > 1) _tile_loadd(3, qpairs + 1 * 16 * g, 4 * g);
    if (steps > 2) _tile_loadd(4, qpairs + 2 * 16 * g, 4 * g);
    if (steps > 3) _tile_loadd(5, qpairs + 3 * 16 * g, 4 * g);
    if (steps > 4) _tile_loadd(6, qpairs + 4 * 16 * g, 4 * g);
    if (steps > 5) _tile_loadd(7, qpairs + 5 * 16 * g, 4 * g);
    const __m512 vscale = _mm512_set1_ps(scale);
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
      _tile_loadd(1, a, stride_bytes);
      _tile_dpbf16ps(0, 1, 2);
      if (steps > 1) { _tile_loadd(1, a + 32, stride_bytes); _tile_dpbf16ps(0, 1, 3); }
      if (steps > 2) { _tile_loadd(1, a + 64, stride_bytes); _tile_dpbf16ps(0, 1, 4); }
      if (steps > 3) { _tile_loadd(1, a + 96, stride_bytes); _tile_dpbf16ps(0, 1, 5); }
      if (steps > 4) { _tile_loadd(1, a + 128, stride_bytes); _tile_dpbf16ps(0, 1, 6); }
      if (steps > 5) { _tile_loadd(1, a + 160, stride_bytes); _tile_dpbf16ps(0, 1, 7); }
      _tile_stored(0, cbuf, 4 * g);
      for (int64_t h = 0; h < g; ++h)
        _mm512_storeu_ps(s + h * s_stride + 16 * c,
                         _mm512_mul_ps(_mm512_i32gather_ps(lane, cbuf + h, 4), vscale));
    }
    _tile_release();
  }
};
#else
struct AmxScores {
  static bool usable(int64_t, int64_t, int64_t) { return false; }
};
#endif

}  // namespace
