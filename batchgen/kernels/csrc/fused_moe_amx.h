// AMX-BF16 micro-kernel of the fused MoE kernel (fused_moe.cpp): tdpbf16ps on 16 x 16 float32
// tiles, blocks of 2 x 2 tiles (32 rows x 32 columns; the tile layout, the tile configuration
// and the OS permission are in amx_bf16.h, shared with packed_linear.cpp).
//
// Activations are row-major (stride K). Rows are padded with zero rows to a multiple of 16
// (their outputs are dropped); K must be a multiple of 32 (`usable`), else the driver runs the
// vdpbf16ps kernel for that GEMM. Per 32 k: two A loads, two B loads, four tdpbf16ps.
//
// Two GEMMs share one loop nest (for_each_block: panel pairs, k blocks of kKc, row blocks):
// `gemm` (the down projection: float32 rows, weighted, non-temporal into y_slots) and
// `gemm_silu` (gate/up: gate panel q beside up panel I / 16 + q, the activation computed
// from the tiles and written as bf16 rows for the down GEMM). Its tile block (`block`) is
// amx_bf16.h's amx_block with a k range, partial sums carried between k blocks, a second
// panel anywhere, and each load placed right before its first product; packed_linear keeps
// amx_block.
//
// Batch invariance: each output row of tdpbf16ps depends on its own A row only, and sums the k
// tiles in order k = 0, 32, 64, ...; so a row's result does not depend on the number of rows.
// Between k blocks the float32 partial sums are stored and reloaded exactly (same order).
// Within one tile the hardware's order of the 32 products is fixed (not documented; tested).
// Tile state is per thread: `gemm` and `gemm_silu` load the configuration and release it
// before returning.
#pragma once

#include "amx_bf16.h"
#include "fused_moe_bf16.h"
#include "fused_moe_common.h"

namespace {

#if BATCHGEN_HAVE_AMX
// amx_bf16.h's target plus AVX512-BW/VL, which the activation (silu_mul_to_bf16_pairs) uses:
// the epilogue inlines it.
#define BATCHGEN_AMX_MOE_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

struct AmxBf16 {
  using In = uint16_t;  // bf16 bits
  static WeightPrefetch moe_prefetch() { return WeightPrefetch::kNone; }  // for_each_block's own
  static constexpr int kMR = 16;
  static constexpr int64_t kRowChunk = 128;
  static constexpr int64_t kStep = 1;  // row-major: consecutive k pairs are adjacent words
  static constexpr bool kZeroPadRows = true;
  static constexpr bool kFusedSilu = true;  // gemm_silu: gate/up GEMM and activation in one
  static int64_t row_offset(int64_t row, int64_t k_size) { return row * k_size; }
  static bool usable(int64_t k_size) { return k_size % 32 == 0; }

  // k per cache block: a GEMM with K > kKc (the bench layer's gate/up, K = H = 512, and its
  // down projection, K = I = 256) runs its k in blocks so that a panel pair's block (kKc x 32
  // bf16 = 8 KiB) stays in L1 while the row blocks stream past it; with the whole K = 512 a
  // panel pair (32 KiB) and a 32-row block of A (32 KiB) overflowed the 48 KiB L1, and both
  // came from L2 at every k step. 128 against 256 (bench layer, random top-8 routing, one
  // thread, process time, loaded machine, same-run A/B, medians of 8): 257 tokens (about 32
  // rows per expert) 5.01 -> 4.51 ms and 4.95 -> 4.29 in a second run, 512 tokens 7.28 ->
  // 6.84 and 7.59 -> 7.03, 16 to 128 and 2,048 tokens 0.97-0.99; 64 was no better than 256.
  // The partial sums wait in cbuf between k blocks, exactly: the same bits.
  static constexpr int64_t kKc = 128;

  // Software prefetch distance along a weight panel (bytes). The weights are streamed once
  // per expert chunk (each tile of B is read once when m <= 32), so a call of few rows per
  // expert waits on the cache level that holds them (the bench layer's 50 MB: L3, about
  // 29 GB/s on one core here). `block` asks for the lines of the tile kPrefetchBytes ahead of
  // the one it loads, in each of its two panel streams: measured (one thread, process time,
  // bench layer, random top-8 routing, machine loaded by other jobs, same-run A/B) 1,024: 16
  // tokens 1.88 -> 1.79 ms, 70: 2.44 -> 2.30; 2,048 bytes: 1.75 and 2.16 (3,072 no better).
  static constexpr int64_t kPrefetchBytes = 2048;

  // MT x NT tiles of C (rows 16 MT of a; panels b0, b1) over k in [k0, k1): the tiles start at
  // zero (first) or at cbuf's partial sums, and end in cbuf [4][16][16].
  template <int MT, int NT>
  BATCHGEN_AMX_MOE_TARGET static void block(const uint16_t* a, int64_t k_size, const uint16_t* b0,
                                            const uint16_t* b1, int64_t k0, int64_t k1, bool first,
                                            float* cbuf, bool prefetch) {
    const uint16_t* a1 = a + 16 * k_size;
    const int64_t stride = k_size * 2;  // bytes per activation row
    if (first) {
      _tile_zero(0);
      if constexpr (NT == 2) _tile_zero(1);
      if constexpr (MT == 2) _tile_zero(2);
      if constexpr (MT == 2 && NT == 2) _tile_zero(3);
    } else {  // exact float32 partial sums: the k order is unchanged
      _tile_loadd(0, cbuf, 64);
      if constexpr (NT == 2) _tile_loadd(1, cbuf + 256, 64);
      if constexpr (MT == 2) _tile_loadd(2, cbuf + 512, 64);
      if constexpr (MT == 2 && NT == 2) _tile_loadd(3, cbuf + 768, 64);
    }
    // Each load is placed right before the first product that reads it: tiles are not
    // renamed, so a load waits for the last product that reads the register's old value.
    for (int64_t k = k0; k < k1; k += 32) {
      if (prefetch) {  // the 16 lines of each panel's tile kPrefetchBytes ahead
        const char* p0 = reinterpret_cast<const char*>(b0 + k * kPanel) + kPrefetchBytes;
        const char* p1 = reinterpret_cast<const char*>(b1 + k * kPanel) + kPrefetchBytes;
        for (int l = 0; l < 1024; l += 64) {
          _mm_prefetch(p0 + l, _MM_HINT_T0);
          if constexpr (NT == 2) _mm_prefetch(p1 + l, _MM_HINT_T0);
        }
      }
      _tile_loadd(4, a + k, stride);
      _tile_loadd(6, b0 + k * kPanel, 64);  // k pairs k / 2 .. k / 2 + 15
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (NT == 2) {
        _tile_loadd(7, b1 + k * kPanel, 64);
        _tile_dpbf16ps(1, 4, 7);
      }
      if constexpr (MT == 2) {
        _tile_loadd(5, a1 + k, stride);
        _tile_dpbf16ps(2, 5, 6);
      }
      if constexpr (MT == 2 && NT == 2) _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, cbuf, 64);
    if constexpr (NT == 2) _tile_stored(1, cbuf + 256, 64);
    if constexpr (MT == 2) _tile_stored(2, cbuf + 512, 64);
    if constexpr (MT == 2 && NT == 2) _tile_stored(3, cbuf + 768, 64);
  }

  // The loop nest of both GEMMs: pairs of panels (b0 = pair_b0(q), b1 = b0 + stride_b1,
  // nt of them real), k blocks, row blocks of 32; after the last k block of a row block,
  // epilogue(row block start i, rows mt * 16, nt, q, cbuf). Each output is summed over
  // k = 0, 32, 64, ... in order (partial sums wait in cacc between k blocks). m <= kRowChunk.
  template <class Epilogue>
  BATCHGEN_AMX_MOE_TARGET static void for_each_block(const uint16_t* a, int64_t m, int64_t k_size,
                                                     const uint16_t* packed, int64_t num_pairs,
                                                     int64_t pair_step, int64_t b1_offset,
                                                     int last_nt, Epilogue& epilogue) {
    alignas(64) float cacc[(kRowChunk + 31) / 32 * 1024];  // [row block][4][16][16]
    for (int64_t q = 0; q < num_pairs; ++q) {
      const int nt = q + 1 < num_pairs ? 2 : last_nt;
      const uint16_t* b0 = packed + q * pair_step;
      const uint16_t* b1 = b0 + b1_offset;
      for (int64_t k0 = 0; k0 < k_size; k0 += kKc) {
        const int64_t k1 = std::min(k0 + kKc, k_size);
        for (int64_t i = 0; i < m; i += 32) {
          const int mt = m - i > 16 ? 2 : 1;
          const uint16_t* ai = a + i * k_size;
          float* cbuf = cacc + (i / 32) * 1024;
          const bool pf = i == 0;  // later row blocks find this k block of B in L1
          if (mt == 2 && nt == 2) block<2, 2>(ai, k_size, b0, b1, k0, k1, k0 == 0, cbuf, pf);
          else if (mt == 2) block<2, 1>(ai, k_size, b0, b1, k0, k1, k0 == 0, cbuf, pf);
          else if (nt == 2) block<1, 2>(ai, k_size, b0, b1, k0, k1, k0 == 0, cbuf, pf);
          else block<1, 1>(ai, k_size, b0, b1, k0, k1, k0 == 0, cbuf, pf);
          if (k1 == k_size) epilogue(i, mt, nt, q, cbuf);
        }
      }
    }
  }

  // c_rows[row][cols of pair q] = scale[row] * C. With a scale (the down GEMM, whose rows are
  // y_slots rows that only the slot-sum pass reads, after every expert is done) and `stream`
  // (the driver's choice: a large call) the rows are written with non-temporal stores where
  // 64-byte aligned: no read for ownership of lines of a buffer far larger than the caches
  // (T x top-k x H floats, 33.5 MB at 2,048 tokens of the bench layer), and no eviction of
  // the weights and activations the GEMMs reuse. Measured
  // (single thread, process time, bench layer, machine loaded): 2,048 tokens 30.8 -> 22.2 ms,
  // 512 tokens 9.0 -> 8.2, 16 tokens 2.19 -> 2.03. gemm fences them before it returns.
  // A small call's y_slots fits the caches, and streaming it to memory only makes the slot
  // sum read it back from DRAM (measured as above, regular stores: 128 tokens 3.00 -> 2.79 ms,
  // 256: 4.82 -> 4.49; 512: 5.55 -> 7.38, hence the driver's kStreamMinBytes).
  struct StoreRows {
    int64_t m;
    float* const* c_rows;
    const float* scale;
    bool stream;
    BATCHGEN_AMX_MOE_TARGET void operator()(int64_t i, int mt, int nt, int64_t q,
                                          const float* cbuf) const {
      for (int tm = 0; tm < mt; ++tm)
        for (int r = 0; r < 16 && i + 16 * tm + r < m; ++r) {
          const int64_t row = i + 16 * tm + r;
          float* c = c_rows[row] + 2 * q * kPanel;
          const float* t = cbuf + 2 * tm * 256 + 16 * r;  // row r of tile (tm, 0)
          if (scale == nullptr) {
            for (int tn = 0; tn < nt; ++tn)
              _mm512_storeu_ps(c + tn * kPanel, _mm512_load_ps(t + tn * 256));
            continue;
          }
          const __m512 s = _mm512_set1_ps(scale[row]);
          const bool aligned = stream && (reinterpret_cast<uintptr_t>(c) & 63) == 0;
          for (int tn = 0; tn < nt; ++tn) {
            const __m512 v = _mm512_mul_ps(_mm512_load_ps(t + tn * 256), s);
            if (aligned) _mm512_stream_ps(c + tn * kPanel, v);
            else _mm512_storeu_ps(c + tn * kPanel, v);
          }
        }
    }
  };

  struct SiluRows {  // act[row][16 q .. 16 q + 15] = bf16(silu(gate) * up), gate and up in C
    int64_t m, inter;
    uint16_t* act;
    BATCHGEN_AMX_MOE_TARGET void operator()(int64_t i, int mt, int, int64_t q,
                                          const float* cbuf) const {
      for (int tm = 0; tm < mt; ++tm)
        for (int r = 0; r < 16 && i + 16 * tm + r < m; ++r) {
          const float* gate = cbuf + 2 * tm * 256 + r * 16;
          uint16_t* o = act + (i + 16 * tm + r) * inter + q * kPanel;
          silu_mul_to_bf16_pairs(gate, gate + 256, kPanel, reinterpret_cast<uint32_t*>(o), 1);
        }
    }
  };

  // a: rows [round_up(m, 16)][K] bf16 (rows past m zero), m <= kRowChunk; packed
  // [N / 16][K / 2][16][2]; c_rows[r][0 : N] = scale[r] * (a[r] . W^T) (scale null: 1),
  // with non-temporal stores when scale and stream (StoreRows).
  BATCHGEN_AMX_MOE_TARGET static void gemm(const uint16_t* a, int64_t m, int64_t k_size,
                                           const uint16_t* packed, int64_t n, float* const* c_rows,
                                           const float* scale, bool stream,
                                           WeightPrefetch /*its own: for_each_block*/ =
                                               WeightPrefetch::kNone) {
    amx_tile_config();
    const int64_t num_panels = n / kPanel, panel = k_size * kPanel;
    StoreRows store{m, c_rows, scale, stream && scale != nullptr};
    for_each_block(a, m, k_size, packed, (num_panels + 1) / 2, 2 * panel, panel,
                   num_panels % 2 ? 1 : 2, store);
    if (store.stream) _mm_sfence();  // the non-temporal stores, before other threads read
    _tile_release();
  }

  // The gate/up GEMM with the activation in its epilogue: packed is w13's [2I / 16][K / 2]
  // [16][2] (gate panels, then up panels); each block pairs gate panel q with up panel
  // I / 16 + q, so a row's 16 gates and 16 ups of columns 16 q .. 16 q + 15 meet in one
  // cbuf and leave as act [round_up(m, 16)][I] bf16 rows (rows < m written), rounded once as
  // in the other kernels (silu_mul_to_bf16_pairs, the same function of the same floats). No
  // float32 [m, 2I] buffer is written and read back. I a multiple of 16.
  BATCHGEN_AMX_MOE_TARGET static void gemm_silu(const uint16_t* a, int64_t m, int64_t k_size,
                                                const uint16_t* packed, int64_t inter,
                                                uint16_t* act) {
    amx_tile_config();
    const int64_t panel = k_size * kPanel;
    SiluRows silu{m, inter, act};
    for_each_block(a, m, k_size, packed, inter / kPanel, panel, inter * k_size, 2, silu);
    _tile_release();
  }
};

#endif

}  // namespace
