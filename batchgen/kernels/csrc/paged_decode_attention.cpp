// Paged decode attention on CPU, float32: one query token per sequence attends to its context
// straight from the paged KV cache (no gathered copy of the context).
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
// Sequences are spread over OpenMP threads. The library is built with -fopenmp and loaded
// after torch, so it joins torch's own OpenMP runtime (libgomp.so.1, already in the process)
// and its thread pool: separate threads would compete with torch's, which spin for a while
// after each parallel region (measured: 40 ms instead of 23 ms right after a matmul).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

struct Args {
  const float* q;
  const float* k_cache;
  const float* v_cache;
  const int64_t* block_tables;
  const int64_t* kv_lens;
  float* out;
  int64_t hq, hkv, d, block_size, max_blocks, sliding_window;
  float scale;
};

// Sequences [seq_begin, seq_end): every head of a sequence at once, so each cached position
// is read as one contiguous [Hkv, D] row (reading one head's D values at a stride of Hkv * D
// ran at a third of the speed).
// Prefetch the cache row of position p + block_size (the same offset in the next block, which
// sits anywhere in the cache: the hardware prefetcher cannot guess it).
inline void prefetch_row(const float* cache, const int64_t* table, int64_t p, int64_t len,
                         int64_t block_size, int64_t row) {
  const int64_t ahead = p + block_size;
  if (ahead >= len) return;
  const char* r = reinterpret_cast<const char*>(
      cache + (table[ahead / block_size] * block_size + ahead % block_size) * row);
  for (int64_t off = 0; off < row * 4; off += 64) __builtin_prefetch(r + off, 0, 0);
}

void run_seqs(const Args& a, int64_t seq_begin, int64_t seq_end) {
  const int64_t g_size = a.hq / a.hkv, row = a.hkv * a.d;
  std::vector<float> scores;  // [Hq, n]
  std::vector<float> acc(a.hq * a.d);
  std::vector<float> inv_sum(a.hq);
  for (int64_t b = seq_begin; b < seq_end; ++b) {
    const int64_t len = a.kv_lens[b];
    const int64_t start =
        a.sliding_window > 0 ? std::max<int64_t>(0, len - a.sliding_window) : 0;
    const int64_t n = len - start;
    const int64_t* table = a.block_tables + b * a.max_blocks;
    const float* q = a.q + b * a.hq * a.d;  // [Hq, D]
    float* out = a.out + b * a.hq * a.d;    // [Hq, D]
    if (n <= 0) {
      std::fill(out, out + a.hq * a.d, 0.0f);
      continue;
    }
    scores.resize(a.hq * n);
    // Scores: s[hq][j] = scale * <q_hq, k_j[hq / G]>.
    for (int64_t j = 0; j < n; ++j) {
      const int64_t p = start + j;
      const float* k = a.k_cache + (table[p / a.block_size] * a.block_size + p % a.block_size) * row;
      prefetch_row(a.k_cache, table, p, len, a.block_size, row);
      for (int64_t hq = 0; hq < a.hq; ++hq) {
        const float* qh = q + hq * a.d;
        const float* kh = k + (hq / g_size) * a.d;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < a.d; ++i) dot += qh[i] * kh[i];
        scores[hq * n + j] = dot * a.scale;
      }
    }
    // Softmax per query head, in float32.
    for (int64_t hq = 0; hq < a.hq; ++hq) {
      float* s = scores.data() + hq * n;
      float m = s[0];
      for (int64_t j = 1; j < n; ++j) m = std::max(m, s[j]);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < n; ++j) {
        s[j] = std::exp(s[j] - m);
        sum += s[j];
      }
      inv_sum[hq] = 1.0f / sum;
    }
    // Weighted sum of values.
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t p = start + j;
      const float* v = a.v_cache + (table[p / a.block_size] * a.block_size + p % a.block_size) * row;
      prefetch_row(a.v_cache, table, p, len, a.block_size, row);
      for (int64_t hq = 0; hq < a.hq; ++hq) {
        const float w = scores[hq * n + j];
        const float* vh = v + (hq / g_size) * a.d;
        float* o = acc.data() + hq * a.d;
#pragma omp simd
        for (int64_t i = 0; i < a.d; ++i) o[i] += w * vh[i];
      }
    }
    for (int64_t hq = 0; hq < a.hq; ++hq)
      for (int64_t i = 0; i < a.d; ++i) out[hq * a.d + i] = acc[hq * a.d + i] * inv_sum[hq];
  }
}

}  // namespace

extern "C" int batchgen_paged_decode_attention_f32(
    const float* q, const float* k_cache, const float* v_cache, const int64_t* block_tables,
    const int64_t* kv_lens, float* out, int64_t num_seqs, int64_t hq, int64_t hkv, int64_t d,
    int64_t block_size, int64_t max_blocks, float scale, int64_t sliding_window,
    int64_t num_threads) {
  if (hkv <= 0 || hq % hkv != 0 || d <= 0 || block_size <= 0) return 1;
  const Args a{q, k_cache, v_cache, block_tables, kv_lens, out,
               hq, hkv, d, block_size, max_blocks, sliding_window, scale};
  num_threads = std::max<int64_t>(1, std::min<int64_t>(num_threads, num_seqs));
  // Small chunks, handed out dynamically: contexts differ in length.
#pragma omp parallel for schedule(dynamic, 4) num_threads(num_threads)
  for (int64_t b = 0; b < num_seqs; ++b) run_seqs(a, b, b + 1);
  return 0;
}
