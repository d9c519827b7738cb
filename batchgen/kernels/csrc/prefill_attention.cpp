// Prefill attention on CPU, float32 and bfloat16: the query tokens of prefill chunks ("spans")
// attend causally to their sequence's context, read in place from the paged KV cache through the
// span's slots (no gathered copy of the context, no materialised mask). The cache holds q's
// dtype or a narrower kv_cache_dtype (float32 q: bf16, fp8 e4m3fn, fp8 e5m2; bf16 q: the fp8
// formats), read exactly (prefill_attention_kv.h), times k_scale / v_scale (folded into the
// score scale and the output).
//
// Flash attention (Dao et al. 2022; FlashAttention-2, Dao 2023, Sec. 3.1 loop order): one task
// holds a block of kTQ = 16 query tokens (two such tiles on the AMX path) of one span and the
// G = Hq / Hkv query heads that share one KV head (they share every key and value tile), keeps
// their outputs in float32, and walks
// the visible keys in blocks of kBK = 32 with an online softmax: per block, scores S, row max m',
// P = exp(S - m'), l = l e^(m - m') + rowsum P, O = O e^(m - m') + P V; at the end O / l.
//
// Layout trick: everything runs transposed, S^T = K Q^T [keys][16 queries] and O^T = V^T P^T
// [D][16 queries], so the 16 queries of a tile are the 16 float32 lanes of one AVX-512 vector:
// the softmax's max, exp, sums and the rescale of O are vertical vector ops, no horizontal
// reductions. O^T is transposed once per task when the output is written.
//
// Layouts (vLLM's slot convention): q, out [T, Hq, D]; k_cache, v_cache [num_slots, Hkv, D];
// spans [S, 4] int64 rows (token_start, num_tokens, kv_len, slot_offset): the span's tokens are
// rows token_start .. + num_tokens of q and out, at positions kv_len - num_tokens .. kv_len - 1;
// slots[slot_offset + p] is the cache slot of position p < kv_len. Visible keys (HF's rule): key
// j for the query at position i iff j <= i and (no window, or i - j < window).
//
// Paths: bf16 with AMX-BF16 where the CPU has it and Linux grants the tile state, D % 32 == 0
// (S^T by `tdpbf16ps` with A = 16 key rows x 32 dims copied from the cache, B = Q^T in pairs;
// O^T by `tdpbf16ps` with A = V^T [16 dims][32 keys], B = P^T in pairs; softmax with the decode
// kernel's `exp_ps`); else AVX-512 where the CPU has it (prefill_attention_vec.h, its per-block
// steps in prefill_attention_vec_steps.h: float32 FMAs, D % 16 == 0; bf16 `vdpbf16ps`,
// D % 32 == 0 and avx512_bf16; the AMX path's layout for S^T, O not transposed); else loops
// the compiler vectorises (float32, bf16 widened exactly to float32). Numerics: products and
// sums in float32; bf16 rounds the unnormalised weights P to bf16 before P V (the sum l stays
// float32) and the output once, as torch's CPU SDPA does in bf16.
//
// Tasks (span, KV head, query block) are spread over OpenMP threads (dynamic: the later blocks
// of a span see more keys), in torch's OpenMP runtime (see paged_decode_attention.cpp).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx_bf16.h"       // amx_usable, amx_tile_config, BATCHGEN_AMX_TARGET
#include "attention_exp.h"  // exp_ps, BATCHGEN_ATTN_BF16_TARGET
#include "fused_moe_common.h"
#include "bf16_rows.h"  // bgrows::to_f32
#include "prefill_attention_kv.h"  // fp8_e4m3, fp8_e5m2, to_f32, stage_row, kVecUnit

namespace {

using bf16_t = uint16_t;
constexpr int64_t kTQ = 16;             // query tokens per task: the 16 lanes / AMX tile rows
constexpr int64_t kBK = 32;             // keys per block
constexpr float kMasked = -3.0e38f;     // score of an invisible key (exp gives 0)
constexpr float kInitMax = -1.0e30f;    // running max before any key: finite, above kMasked

using bgrows::to_f32;  // float32 as is, bf16 bits widened exactly (bf16_rows.h)
inline void store(float* p, float x) { *p = x; }
inline void store(bf16_t* p, float x) { *p = to_bf16(x); }
inline float round_bf16(float x) { return to_f32(to_bf16(x)); }

// T: q's and out's element type; C: the caches' (T, or a narrower kv_cache_dtype).
template <class T, class C = T>
struct Args {
  const T* q;
  const C* k_cache;
  const C* v_cache;
  T* out;
  const int64_t* spans;  // [S, 4]
  const int64_t* slots;
  int64_t hq, hkv, d, window;
  float scale;       // the softmax scale times k_scale (times the AVX-512 path's K unit)
  int64_t q_stride;  // elements between two tokens' queries (>= hq * d; a view of fused QKV)
  float v_scale;     // the output's factor: v_scale (times the AVX-512 path's V unit)
};

// One task's geometry: tokens i0 .. i0 + nq - 1 of a span, at positions p0 .. p0 + nq - 1,
// keys [lo, hi] (hi = p0 + nq - 1, the last query's position).
struct Task {
  int64_t span, kv, i0, nq, p0, lo, hi;
  const int64_t* slots;  // the span's slots, by position
};

template <class T, class C>
inline Task make_task(const Args<T, C>& a, int64_t span, int64_t kv, int64_t i0) {
  const int64_t* sp = a.spans + 4 * span;
  const int64_t n = sp[1], base = sp[2] - n;
  Task t{span, kv, i0, std::min(kTQ, n - i0), base + i0, 0, 0, a.slots + sp[3]};
  t.hi = t.p0 + t.nq - 1;
  t.lo = a.window > 0 ? std::max<int64_t>(0, t.p0 - a.window + 1) : 0;
  return t;
}

// Whether key j is visible to lane q of the task (lanes past nq use the positions that would
// follow: finite results, never written).
inline bool visible(const Task& t, int64_t window, int64_t j, int64_t q) {
  const int64_t pos = t.p0 + q;
  return j <= pos && (window <= 0 || pos - j < window);
}
// Whether any key of [kb, kb + nk) is hidden from some lane < 16.
inline bool block_needs_mask(const Task& t, int64_t window, int64_t kb, int64_t nk) {
  return kb + nk - 1 > t.p0 || (window > 0 && kb <= t.p0 + kTQ - 1 - window) || nk < kBK;
}

template <class T, class C>
inline const C* cache_row(const C* cache, const Args<T, C>& a, const Task& t, int64_t j) {
  return cache + (t.slots[j] * a.hkv + t.kv) * a.d;
}

// Writes out rows of the task: out[token][kv * G + h][dd] = ot[h][dd][q] / l[h][q].
template <class T, class C>
void write_out(const Args<T, C>& a, const Task& t, const float* ot, const float* l) {
  const int64_t g = a.hq / a.hkv, d = a.d;
  const int64_t tok0 = a.spans[4 * t.span] + t.i0;
  for (int64_t h = 0; h < g; ++h)
    for (int64_t q = 0; q < t.nq; ++q) {
      T* o = a.out + ((tok0 + q) * a.hq + t.kv * g + h) * d;
      const float inv = a.v_scale / l[h * kTQ + q];
      const float* src = ot + h * d * kTQ + q;
      for (int64_t dd = 0; dd < d; ++dd) store(o + dd, src[dd * kTQ] * inv);
    }
}

// ---- the generic path (float32; bf16 widened) ---------------------------------------------

struct Scratch {
  std::vector<float, CacheAligned<float>> qt, kp, vp, s, ot, m, l;
#if BATCHGEN_HAVE_BF16
  std::vector<bf16_t, CacheAligned<bf16_t>> qv, kb, vt, pv;
#endif
};

template <class T, class C>
void run_task_generic(const Args<T, C>& a, const Task& t, Scratch& s) {
  const int64_t g = a.hq / a.hkv, d = a.d;
  const int64_t tok0 = a.spans[4 * t.span] + t.i0;
  s.qt.assign(g * d * kTQ, 0.0f);  // [G][D][16]
  s.ot.assign(g * d * kTQ, 0.0f);
  s.m.assign(g * kTQ, kInitMax);
  s.l.assign(g * kTQ, 0.0f);
  s.kp.resize(kBK * d);
  s.vp.resize(kBK * d);
  s.s.resize(kBK * kTQ);
  for (int64_t h = 0; h < g; ++h)
    for (int64_t q = 0; q < t.nq; ++q) {
      const T* qr = a.q + (tok0 + q) * a.q_stride + (t.kv * g + h) * d;
      for (int64_t dd = 0; dd < d; ++dd) s.qt[(h * d + dd) * kTQ + q] = to_f32(qr[dd]);
    }
  for (int64_t kb = t.lo; kb <= t.hi; kb += kBK) {
    const int64_t nk = std::min(kBK, t.hi + 1 - kb);
    for (int64_t k = 0; k < nk; ++k) {
      const C* kr = cache_row(a.k_cache, a, t, kb + k);
      const C* vr = cache_row(a.v_cache, a, t, kb + k);
      for (int64_t dd = 0; dd < d; ++dd) {
        s.kp[k * d + dd] = to_f32(kr[dd]);
        s.vp[k * d + dd] = to_f32(vr[dd]);
      }
    }
    const bool masked = block_needs_mask(t, a.window, kb, nk);
    for (int64_t h = 0; h < g; ++h) {
      const float* qt = s.qt.data() + h * d * kTQ;
      float* st = s.s.data();
      for (int64_t k = 0; k < nk; ++k) {  // S^T[k][q] = scale <K_k, Q_q>
        float acc[kTQ] = {};
        const float* kr = s.kp.data() + k * d;
        for (int64_t dd = 0; dd < d; ++dd)
#pragma omp simd
          for (int64_t q = 0; q < kTQ; ++q) acc[q] += kr[dd] * qt[dd * kTQ + q];
        for (int64_t q = 0; q < kTQ; ++q) st[k * kTQ + q] = acc[q] * a.scale;
      }
      if (masked)
        for (int64_t k = 0; k < nk; ++k)
          for (int64_t q = 0; q < kTQ; ++q)
            if (!visible(t, a.window, kb + k, q)) st[k * kTQ + q] = kMasked;
      float* m = s.m.data() + h * kTQ;
      float* l = s.l.data() + h * kTQ;
      float mnew[kTQ], alpha[kTQ], rsum[kTQ] = {};
      for (int64_t q = 0; q < kTQ; ++q) mnew[q] = m[q];
      for (int64_t k = 0; k < nk; ++k)
        for (int64_t q = 0; q < kTQ; ++q) mnew[q] = std::max(mnew[q], st[k * kTQ + q]);
      for (int64_t q = 0; q < kTQ; ++q) alpha[q] = std::exp(m[q] - mnew[q]);
      for (int64_t k = 0; k < nk; ++k)
        for (int64_t q = 0; q < kTQ; ++q) {
          const float p = std::exp(st[k * kTQ + q] - mnew[q]);
          rsum[q] += p;
          st[k * kTQ + q] = std::is_same_v<T, bf16_t> ? round_bf16(p) : p;
        }
      for (int64_t q = 0; q < kTQ; ++q) {
        l[q] = l[q] * alpha[q] + rsum[q];
        m[q] = mnew[q];
      }
      float* ot = s.ot.data() + h * d * kTQ;
      // O^T[dd][q] = alpha O^T[dd][q] + sum_k V[k][dd] P^T[k][q]
      for (int64_t dd = 0; dd < d; ++dd) {
        float acc[kTQ];
        for (int64_t q = 0; q < kTQ; ++q) acc[q] = ot[dd * kTQ + q] * alpha[q];
        for (int64_t k = 0; k < nk; ++k) {
          const float v = s.vp[k * d + dd];
#pragma omp simd
          for (int64_t q = 0; q < kTQ; ++q) acc[q] += v * st[k * kTQ + q];
        }
        for (int64_t q = 0; q < kTQ; ++q) ot[dd * kTQ + q] = acc[q];
      }
    }
  }
  write_out(a, t, s.ot.data(), s.l.data());
}

}  // namespace
#include "prefill_attention_amx.h"  // run_tiles_amx, amx_path_usable
#include "prefill_attention_vec.h"  // run_task_vec, vec_path_usable (+ its _steps.h)
namespace {

enum Path : int64_t { kGeneric = 0, kVec = 1, kAmx = 2 };

// The path for isa (0 auto: AMX, else AVX-512, else generic; 1 generic; 2 AVX-512; 3 AMX) on
// this CPU for q's dtype (bf16 or float32) and the caches' (KvCode), or -1 where a forced path
// is unusable here. AMX serves a bf16 cache only.
inline int64_t pick_path(bool bf16, int64_t cache, int64_t d, int64_t isa) {
  const bool amx = bf16 && cache == kBf16 && amx_path_usable(d), vec = vec_path_usable(bf16, d);
  switch (isa) {
    case 0: return amx ? kAmx : vec ? kVec : kGeneric;
    case 1: return kGeneric;
    case 2: return vec ? kVec : -1;
    case 3: return amx ? kAmx : -1;
    default: return -1;
  }
}

template <class T, class C>
int run(Args<T, C> a, int64_t num_spans, int64_t num_threads, int64_t path) {
  const bool amx = path == kAmx;
  if (a.hkv <= 0 || a.hq % a.hkv != 0 || a.d <= 0) return 1;
  if (path == kVec) {  // its converters read an e4m3 cache as x / 2^8: scores and output times 2^8
    a.scale *= kVecUnit<C>;
    a.v_scale *= kVecUnit<C>;
  }
  // A window at least as long as every context hides nothing: run it as none, so the AMX
  // path's int32 position compares never see a window above 2^31 - 1 (it wrapped negative).
  int64_t max_kv_len = 0;
  for (int64_t sp = 0; sp < num_spans; ++sp)
    max_kv_len = std::max(max_kv_len, a.spans[4 * sp + 2]);
  if (max_kv_len > INT32_MAX) return 3;  // positions are int32 in the AMX masks
  if (a.window >= max_kv_len) a.window = 0;
  // AMX tasks hold two 16-token tiles (the key blocks packed once for both), as do AVX-512
  // tasks on a cache of another dtype (each key block converted once for both).
  const bool two_tiles = amx || (path == kVec && !std::is_same_v<T, C>);
  const int64_t step = two_tiles ? 2 * kTQ : kTQ;
  std::vector<std::pair<int64_t, int64_t>> blocks;  // (span, i0), the longest key ranges first
  for (int64_t sp = 0; sp < num_spans; ++sp) {
    const int64_t n = a.spans[4 * sp + 1];
    for (int64_t i0 = (n - 1) / step * step; i0 >= 0; i0 -= step) blocks.emplace_back(sp, i0);
  }
  std::stable_sort(blocks.begin(), blocks.end(), [&](const auto& x, const auto& y) {
    return a.spans[4 * x.first + 2] - a.spans[4 * x.first + 1] + x.second >
           a.spans[4 * y.first + 2] - a.spans[4 * y.first + 1] + y.second;
  });
  const int64_t num_tasks = int64_t(blocks.size()) * a.hkv;
  num_threads = std::max<int64_t>(1, std::min(num_threads, num_tasks));
#pragma omp parallel num_threads(num_threads)
  {
    Scratch s;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_tasks; ++i) {
      const auto& b = blocks[i / a.hkv];
      const Task t = make_task(a, b.first, i % a.hkv, b.second);
      const bool second = two_tiles && b.second + kTQ < a.spans[4 * b.first + 1];
      const Task tiles[2] = {t, second ? make_task(a, b.first, i % a.hkv, b.second + kTQ) : t};
      if constexpr (std::is_same_v<T, bf16_t> && std::is_same_v<C, bf16_t>)
        if (amx) {
          run_tiles_amx(a, tiles, second ? 2 : 1, s);
          continue;
        }
      if (path == kVec)
        run_task_vec(a, tiles, second ? 2 : 1, s);
      else
        run_task_generic(a, t, s);
    }
  }
  return 0;
}

template <class T, class C>
int run_pair(const void* q, const void* k_cache, const void* v_cache, void* out,
             const int64_t* spans, const int64_t* slots, int64_t num_spans, int64_t hq,
             int64_t hkv, int64_t d, float scale, int64_t window, int64_t num_threads,
             int64_t path, int64_t q_stride, float k_scale, float v_scale) {
  const Args<T, C> a{static_cast<const T*>(q),
                     static_cast<const C*>(k_cache),
                     static_cast<const C*>(v_cache),
                     static_cast<T*>(out),
                     spans,
                     slots,
                     hq,
                     hkv,
                     d,
                     window,
                     scale * k_scale,
                     q_stride,
                     v_scale};
  return run(a, num_spans, num_threads, path);
}

}  // namespace

// q, out: float32 (q_dtype 0) or bf16 (1); k_cache, v_cache: cache_dtype (KvCode: 0 float32,
// 1 bf16, 2 fp8 e4m3fn, 3 fp8 e5m2), q's dtype or narrower (float32 q: any; bf16 q: bf16 or
// fp8); k_scale, v_scale multiply the stored K and V. isa: 0 auto
// (`batchgen_prefill_attention_isa`), 1 the generic loops, 2 AVX-512 (AVX-512F for float32,
// AVX512-BF16 for bf16), 3 AMX (bf16 q and cache). Returns 0, or 1 bad head counts, 2 q_stride
// below hq * d, 3 a kv_len above 2^31 - 1, 4 a forced path unusable on this CPU for the dtypes
// and head size d, 5 a dtype pair not served.
extern "C" int batchgen_prefill_attention(const void* q, const void* k_cache,
                                          const void* v_cache, void* out, const int64_t* spans,
                                          const int64_t* slots, int64_t num_spans, int64_t hq,
                                          int64_t hkv, int64_t d, float scale, int64_t window,
                                          int64_t num_threads, int64_t isa, int64_t q_stride,
                                          int64_t q_dtype, int64_t cache_dtype, float k_scale,
                                          float v_scale) {
  if (q_stride < hq * d) return 2;
  if ((q_dtype != kF32 && q_dtype != kBf16) || cache_dtype < kF32 || cache_dtype > kE5m2 ||
      (q_dtype == kBf16 && cache_dtype == kF32))
    return 5;
  const int64_t path = pick_path(q_dtype == kBf16, cache_dtype, d, isa);
  if (path < 0) return 4;
  auto go = [&](auto tq, auto tc) {
    using T = decltype(tq);
    using C = decltype(tc);
    return run_pair<T, C>(q, k_cache, v_cache, out, spans, slots, num_spans, hq, hkv, d, scale,
                          window, num_threads, path, q_stride, k_scale, v_scale);
  };
  if (q_dtype == kF32) switch (cache_dtype) {
      case kF32: return go(float{}, float{});
      case kBf16: return go(float{}, bf16_t{});
      case kE4m3: return go(float{}, fp8_e4m3{});
      default: return go(float{}, fp8_e5m2{});
    }
  switch (cache_dtype) {
    case kBf16: return go(bf16_t{}, bf16_t{});
    case kE4m3: return go(bf16_t{}, fp8_e4m3{});
    default: return go(bf16_t{}, fp8_e5m2{});
  }
}

// The path under isa 0 for q bf16 (or float32), the cache's KvCode and head size d: 2 AMX,
// 1 AVX-512, 0 generic.
extern "C" int batchgen_prefill_attention_isa(int64_t bf16, int64_t cache_dtype, int64_t d) {
  return int(pick_path(bf16 != 0, cache_dtype, d, 0));
}
