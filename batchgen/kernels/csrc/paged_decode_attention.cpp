// Paged decode attention on CPU, float32 and bfloat16: one query token per sequence attends to
// its context straight from the paged KV cache (no gathered copy of the context).
//
// Layouts (vLLM's slot convention): k_cache, v_cache [num_slots, Hkv, D] with
// num_slots = num_blocks * block_size; position p of sequence b lives in slot
// block_tables[b][p / block_size] * block_size + p % block_size.
//
// Per sequence: every query head is scored against every visible key (one read of K, query
// head hq reading KV head hq / G, G = Hq / Hkv: HF's `repeat_kv` order), softmaxed in
// float32, and the values are summed (one read of V). Visible keys: positions [start, kv_len) with start = kv_len - window
// under a sliding window (HF's rule: pos - j < window, pos = kv_len - 1), else 0.
//
// Two entry points, one code templated on the element type T of q, the caches and out:
//   batchgen_paged_decode_attention_f32:  T = float.
//   batchgen_paged_decode_attention_bf16: T = bfloat16 (stored as uint16_t). On the
//     AVX-512F, AVX2 and generic paths every bf16 value is widened exactly to float32 (its 16
//     bits shifted into the high half of a float32: plain integer instructions); the
//     AVX512-BF16 path multiplies bf16 pairs (`vdpbf16ps`, `tdpbf16ps`: exact products, float32
//     sums). Scores, softmax and the weighted sum are float32; like torch's CPU SDPA in bf16,
//     the unnormalised softmax weights are rounded
//     to bf16 before the weighted sum (`softmax_heads`), and the output is rounded to bf16
//     (round to nearest even).
//
// Implementations: generic loops (any head size, any CPU) and vector paths, chosen per call:
// bf16 only, AVX512-BF16 (`vdpbf16ps`, per KV head, paged_decode_attention_bf16.h; its scores
// and P @ V by AMX-BF16 `tdpbf16ps` where the CPU has AMX, Linux grants the tile state, blocks
// are a multiple of 16, D <= 192 and G <= 16: paged_decode_attention_amx.h) for head sizes that are
// a multiple of 32 where the CPU has avx512_bf16 (checked at run time); else
// AVX-512F (16 floats a vector, bf16 widened to float32) for multiples of 16 where the library
// is compiled for AVX-512F; float32: AVX-512F for head sizes 64 and 128 with an even number of
// query heads per KV head (paged_decode_attention_f32.h: AVX2's scores bit for bit, its own
// 16-lane softmax); else AVX2/FMA
// (8 floats) for multiples of 8. Both entries take `isa` (0: auto, 1:
// AVX2, 2: generic loops, 3: AVX-512F, 4: AVX512-BF16, 5: AVX512-BF16 with AMX scores; a
// forced path that does not apply to the shapes or CPU falls back down that list) so tests and
// A/B measurements reach every path on one machine.
//
// A third entry, batchgen_paged_decode_attention_mixed, reads a KV cache narrower than q (q
// float32 over bf16, e4m3fn or e5m2; q bf16 over fp8; vLLM's kv_cache_dtype) with per-cache
// scales: AVX-512F for head sizes 64 and 128, else generic loops
// (paged_decode_attention_mixed.h; the cache's element types and their conversion to float32:
// paged_decode_attention_kv.h, which it includes).
//
// Sequences are spread over OpenMP threads, longest context first, one at a time. The library is built with -fopenmp and loaded
// after torch, so it joins torch's own OpenMP runtime (libgomp.so.1, already in the process)
// and its thread pool: separate threads would compete with torch's, which spin for a while
// after each parallel region (measured: 40 ms instead of 23 ms right after a matmul).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "bf16_rows.h"  // bgrows::to_f32

namespace {

using bf16_t = uint16_t;

using bgrows::to_f32;  // float32 as is, bf16 bits widened exactly (bf16_rows.h)
inline void store(float* p, float x) { *p = x; }
// Round to nearest even (finite inputs: the kernel never makes inf or NaN from valid input).
inline void store(bf16_t* p, float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  *p = bf16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

enum Isa : int64_t { kAuto = 0, kAvx2 = 1, kGeneric = 2, kAvx512 = 3, kAvx512Bf16 = 4, kAmx = 5 };

template <class T>
struct Args {
  const T* q;
  const T* k_cache;
  const T* v_cache;
  const int64_t* block_tables;
  const int64_t* kv_lens;
  T* out;
  int64_t hq, hkv, d, block_size, max_blocks, sliding_window;
  float scale;
  int64_t isa;
  int64_t q_stride;  // elements between two sequences' queries (>= hq * d; a view of fused QKV)
};

// Prefetch the cache row of position p + block_size (the same offset in the next block, which
// sits anywhere in the cache: the hardware prefetcher cannot guess it).
template <class T>
inline void prefetch_row(const T* cache, const int64_t* table, int64_t p, int64_t len,
                         int64_t block_size, int64_t row) {
  const int64_t ahead = p + block_size;
  if (ahead >= len) return;
  const char* r = reinterpret_cast<const char*>(
      cache + (table[ahead / block_size] * block_size + ahead % block_size) * row);
  for (int64_t off = 0; off < row * int64_t(sizeof(T)); off += 64)
    __builtin_prefetch(r + off, 0, 0);
}

// x rounded to the nearest bfloat16 (ties to even), kept as a float32.
inline float round_to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Softmax of each query head's scores ``s[hq * stride + j]``, j < n, in place (unnormalised
// exponentials), in float32; ``inv_sum[hq]`` receives 1 / their sum. For bf16 (T = bf16_t) the
// weights are then rounded to bf16, the sum staying that of the float32 exponentials: what
// torch's CPU SDPA does in bf16 (`_exp_reduce_sum_fusion_kernel` writes the rounded weights for
// its P @ V GEMM, the sum accumulates unrounded), so that a token decoded here and the same
// token recomputed by a bf16 prefill (torch SDPA) see the same attention up to summation order.
template <class T>
inline void softmax_heads(float* scores, int64_t stride, int64_t n, int64_t hq_count,
                          float* inv_sum) {
  for (int64_t hq = 0; hq < hq_count; ++hq) {
    float* s = scores + hq * stride;
    float m = s[0];
    for (int64_t j = 1; j < n; ++j) m = std::max(m, s[j]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      s[j] = std::exp(s[j] - m);
      sum += s[j];
    }
    inv_sum[hq] = 1.0f / sum;
    if constexpr (std::is_same_v<T, bf16_t>)
      for (int64_t j = 0; j < n; ++j) s[j] = round_to_bf16(s[j]);
  }
}

// acc[hq] += w[hq * stride + j] * v[hq / G] for every query head: one cached value row.
template <class T>
inline void add_value_row(float* acc, const float* w, int64_t stride, int64_t j, const T* v,
                          int64_t hq_count, int64_t g_size, int64_t d) {
  for (int64_t hq = 0; hq < hq_count; ++hq) {
    const float wj = w[hq * stride + j];
    const T* vh = v + (hq / g_size) * d;
    float* o = acc + hq * d;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) o[i] += wj * to_f32(vh[i]);
  }
}

// Per-thread buffers, reused across the sequences a thread runs.
struct Scratch {
  std::vector<float> qf, scores, acc, inv_sum;  // [Hq, D], [Hq, n], [Hq, D], [Hq]
  std::vector<float> qpair;  // the float32 AVX-512F path's query head pairs, [Hq / 2, D / 8, 16]
};

// The sequence's query as float32 into ``s.qf``; its window [start, len); false when empty
// (the output is then zeros).
template <class T>
bool begin_seq(const Args<T>& a, int64_t b, Scratch& s, int64_t& start, int64_t& n) {
  const int64_t len = a.kv_lens[b];
  start = a.sliding_window > 0 ? std::max<int64_t>(0, len - a.sliding_window) : 0;
  n = len - start;
  if (n <= 0) {
    T* out = a.out + b * a.hq * a.d;
    for (int64_t i = 0; i < a.hq * a.d; ++i) store(out + i, 0.0f);
    return false;
  }
  s.qf.resize(a.hq * a.d);
  s.acc.assign(a.hq * a.d, 0.0f);
  s.inv_sum.resize(a.hq);
  const T* q = a.q + b * a.q_stride;
  for (int64_t i = 0; i < a.hq * a.d; ++i) s.qf[i] = to_f32(q[i]);
  return true;
}

template <class T>
void end_seq(const Args<T>& a, int64_t b, const Scratch& s) {
  T* out = a.out + b * a.hq * a.d;  // [Hq, D]
  for (int64_t hq = 0; hq < a.hq; ++hq)
    for (int64_t i = 0; i < a.d; ++i)
      store(out + hq * a.d + i, s.acc[hq * a.d + i] * s.inv_sum[hq]);
}

template <class T>
void run_seq_generic(const Args<T>& a, int64_t b, Scratch& s) {
  const int64_t g_size = a.hq / a.hkv, row = a.hkv * a.d;
  int64_t start, n;
  if (!begin_seq(a, b, s, start, n)) return;
  const int64_t len = a.kv_lens[b];
  const int64_t* table = a.block_tables + b * a.max_blocks;
  s.scores.resize(a.hq * n);
  // Scores: s[hq][j] = scale * <q_hq, k_j[hq / G]>.
  for (int64_t j = 0; j < n; ++j) {
    const int64_t p = start + j;
    const T* k = a.k_cache + (table[p / a.block_size] * a.block_size + p % a.block_size) * row;
    prefetch_row(a.k_cache, table, p, len, a.block_size, row);
    for (int64_t hq = 0; hq < a.hq; ++hq) {
      const float* qh = s.qf.data() + hq * a.d;
      const T* kh = k + (hq / g_size) * a.d;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < a.d; ++i) dot += qh[i] * to_f32(kh[i]);
      s.scores[hq * n + j] = dot * a.scale;
    }
  }
  softmax_heads<T>(s.scores.data(), n, n, a.hq, s.inv_sum.data());
  for (int64_t j = 0; j < n; ++j) {
    const int64_t p = start + j;
    const T* v = a.v_cache + (table[p / a.block_size] * a.block_size + p % a.block_size) * row;
    prefetch_row(a.v_cache, table, p, len, a.block_size, row);
    add_value_row(s.acc.data(), s.scores.data(), n, j, v, a.hq, g_size, a.d);
  }
  end_seq(a, b, s);
}

}  // namespace
#include "paged_decode_attention_vec.h"   // the AVX-512F and AVX2 paths
#include "paged_decode_attention_f32.h"   // the float32 AVX-512F path
#include "paged_decode_attention_bf16.h"  // the AVX512-BF16 path (AMX scores)
namespace {

// Per-thread buffers of the vector paths: row pointers, [n rounded up to 8]; the bf16 path's.
template <class T>
struct Rows {
  std::vector<const T*> k, v;
  Bf16Scratch bf16;
};

// Whether `isa` (auto or forced) runs the AVX512-BF16 path for head size d on this CPU.
inline bool bf16_path(int64_t isa, int64_t d) {
  return (isa == kAuto || isa >= kAvx512Bf16) && d % 32 == 0 && avx512_bf16_usable();
}
// Whether that path takes its scores and P @ V from AMX.
inline bool amx_scores(int64_t isa, int64_t d, int64_t g, int64_t block_size) {
  return (isa == kAuto || isa == kAmx) && bf16_path(isa, d) && AmxTiles::usable(d, g, block_size);
}

template <class T>
void run_seq(const Args<T>& a, int64_t b, Scratch& s, Rows<T>& rows, int64_t next) {
  if constexpr (std::is_same_v<T, bf16_t>)
    if (bf16_path(a.isa, a.d))
      return run_seq_bf16(a, b, rows.bf16, amx_scores(a.isa, a.d, a.hq / a.hkv, a.block_size),
                          next);
  (void)next;
#if defined(__AVX2__) && defined(__FMA__)
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    // The AVX2 path's scores bit for bit, a 16-lane softmax (paged_decode_attention_f32.h).
    if ((a.isa == kAuto || a.isa >= kAvx512) && f32_avx512_applies(a.d, a.hq / a.hkv))
      return a.d == 64 ? run_seq_f32_avx512<64>(a, b, s, rows.k, rows.v)
                       : run_seq_f32_avx512<128>(a, b, s, rows.k, rows.v);
  } else if ((a.isa == kAuto || a.isa >= kAvx512) && a.d % 16 == 0) {
    return run_seq_vector<Avx512>(a, b, s, rows.k, rows.v);
  }
#endif
  if (a.isa != kGeneric && a.d % 8 == 0) return run_seq_vector<Avx2>(a, b, s, rows.k, rows.v);
#endif
  (void)rows;
  run_seq_generic(a, b, s);
}

// Longest context first, one sequence at a time (dynamic): the threads finish within about
// the shortest sequence of each other. Chunks of 4 in batch order left up to 4 long contexts
// (1,500 positions against a mean near 400) to one thread at the end. Empty (batch order)
// for one thread.
inline std::vector<int64_t> longest_first(const int64_t* kv_lens, int64_t num_seqs,
                                          int64_t num_threads) {
  std::vector<int64_t> order;
  if (num_threads > 1) {
    order.resize(num_seqs);
    for (int64_t b = 0; b < num_seqs; ++b) order[b] = b;
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t x, int64_t y) { return kv_lens[x] > kv_lens[y]; });
  }
  return order;
}

template <class T>
int run(const Args<T>& a, int64_t num_seqs, int64_t num_threads) {
  if (a.hkv <= 0 || a.hq % a.hkv != 0 || a.d <= 0 || a.block_size <= 0) return 1;
  num_threads = std::max<int64_t>(1, std::min<int64_t>(num_threads, num_seqs));
  bool amx = false;
  if constexpr (std::is_same_v<T, bf16_t>) amx = amx_scores(a.isa, a.d, a.hq / a.hkv, a.block_size);
  const std::vector<int64_t> order = longest_first(a.kv_lens, num_seqs, num_threads);
#pragma omp parallel num_threads(num_threads)
  {
    Scratch s;
    Rows<T> rows;
    if (amx) AmxTiles::configure(a.hq / a.hkv);  // this thread's tiles, for all its sequences
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_seqs; ++i) {
      // The sequence this thread probably takes next: num_threads further down the order.
      const int64_t j = i + num_threads;
      const int64_t next = j >= num_seqs ? -1 : order.empty() ? j : order[j];
      run_seq(a, order.empty() ? i : order[i], s, rows, next);
    }
    if (amx) AmxTiles::release();
  }
  return 0;
}

}  // namespace
#include "paged_decode_attention_mixed.h"  // q over a narrower KV cache (+ its _kv.h types)

extern "C" int batchgen_paged_decode_attention_f32(
    const float* q, const float* k_cache, const float* v_cache, const int64_t* block_tables,
    const int64_t* kv_lens, float* out, int64_t num_seqs, int64_t hq, int64_t hkv, int64_t d,
    int64_t block_size, int64_t max_blocks, float scale, int64_t sliding_window,
    int64_t num_threads, int64_t isa, int64_t q_stride) {
  if (isa < kAuto || isa > kAmx || q_stride < hq * d) return 2;
  const Args<float> a{q,  k_cache, v_cache, block_tables, kv_lens,        out,
                      hq, hkv,     d,       block_size,   max_blocks,     sliding_window,
                      scale, isa, q_stride};
  return run(a, num_seqs, num_threads);
}

extern "C" int batchgen_paged_decode_attention_bf16(
    const bf16_t* q, const bf16_t* k_cache, const bf16_t* v_cache, const int64_t* block_tables,
    const int64_t* kv_lens, bf16_t* out, int64_t num_seqs, int64_t hq, int64_t hkv, int64_t d,
    int64_t block_size, int64_t max_blocks, float scale, int64_t sliding_window,
    int64_t num_threads, int64_t isa, int64_t q_stride) {
  if (isa < kAuto || isa > kAmx || q_stride < hq * d) return 2;
  const Args<bf16_t> a{q,  k_cache, v_cache, block_tables, kv_lens,    out,
                       hq, hkv,     d,       block_size,   max_blocks, sliding_window,
                       scale, isa, q_stride};
  return run(a, num_seqs, num_threads);
}

// q float32 (q_dtype 0) or bf16 (1) over a cache of kv_dtype (KvDtype: 0 bf16 with float32 q,
// 1 float8_e4m3fn, 2 float8_e5m2), a key worth stored * k_scale, a value stored * v_scale
// (paged_decode_attention_mixed.h). Returns 3 for another pairing.
extern "C" int batchgen_paged_decode_attention_mixed(
    const void* q, const void* k_cache, const void* v_cache, const int64_t* block_tables,
    const int64_t* kv_lens, void* out, int64_t num_seqs, int64_t hq, int64_t hkv, int64_t d,
    int64_t block_size, int64_t max_blocks, float scale, int64_t sliding_window,
    int64_t num_threads, int64_t isa, int64_t q_stride, int64_t q_dtype, int64_t kv_dtype,
    double k_scale, double v_scale) {
  if (isa < kAuto || isa > kAmx || q_stride < hq * d) return 2;
  auto go = [&](auto* qt) {
    using Q = std::remove_const_t<std::remove_pointer_t<decltype(qt)>>;
    const Args<Q> a{qt,    nullptr,        nullptr,      block_tables, kv_lens,
                    static_cast<Q*>(out),  hq,           hkv,          d,
                    block_size,            max_blocks,   sliding_window, scale,
                    isa,   q_stride};
    return run_mixed_cache(a, k_cache, v_cache, kv_dtype, k_scale, v_scale, num_seqs,
                           num_threads);
  };
  if (q_dtype == 0) return go(static_cast<const float*>(q));
  if (q_dtype == 1) return go(static_cast<const bf16_t*>(q));
  return 3;
}

// The path the mixed entry runs with isa 0 for head size d: 2 AVX-512F, 0 the generic loops.
extern "C" int batchgen_paged_decode_attention_mixed_isa(int64_t d) {
#if defined(__AVX512F__)
  if (mixed_avx512_applies(kAuto, d)) return 2;
#endif
  (void)d;
  return 0;
}

// The vector path the bf16 entry runs with isa 0 for head size d, g query heads per KV head
// and blocks of block_size: 4 AVX512-BF16 with AMX scores, 3 AVX512-BF16, 2 AVX-512F, 1 AVX2,
// 0 the generic loops.
extern "C" int batchgen_paged_decode_attention_bf16_isa(int64_t d, int64_t g, int64_t block_size) {
  if (amx_scores(kAuto, d, g, block_size)) return 4;
  if (bf16_path(kAuto, d)) return 3;
#if defined(__AVX2__) && defined(__FMA__)
#if defined(__AVX512F__)
  if (d % 16 == 0) return 2;
#endif
  if (d % 8 == 0) return 1;
#endif
  (void)d;
  return 0;
}

// The path the float32 entry runs with isa 0 for head size d and g query heads per KV head:
// 2 AVX-512F (paged_decode_attention_f32.h), 1 AVX2, 0 the generic loops.
extern "C" int batchgen_paged_decode_attention_f32_isa(int64_t d, int64_t g) {
#if defined(__AVX2__) && defined(__FMA__)
#if defined(__AVX512F__)
  if (f32_avx512_applies(d, g)) return 2;
#endif
  if (d % 8 == 0) return 1;
#endif
  (void)d;
  (void)g;
  return 0;
}
