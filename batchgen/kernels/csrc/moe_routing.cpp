// MoE routing on CPU: top-k + optional renormalisation of the router's probabilities in one
// call (the selection half of vLLM's `topk_softmax`), and the stable counting sort of the chosen
// experts (`moe_sort`).
//
// topk_renorm, per row of probabilities p [T, E] float32 (torch.softmax's output: the caller
// keeps torch's softmax, so the probabilities are HF's bit for bit), in Hugging Face
// `MixtralTopKRouter` / `Qwen2MoeTopKRouter`'s order of operations:
//
//   (w, ids) = topk(p, k)                torch.topk's CPU result, ties included
//   if renormalize: w = w / sum(w)       true division, the sum in slot order
//   w = w * scale                        (scale 1: left out)
//
// The top-k is torch's (aten/src/ATen/native/TopKImpl.h, `topk_impl_loop`): (value, index)
// pairs, std::partial_sort when k * 64 <= E else std::nth_element then std::sort of the first
// k - 1, with its comparator (NaN first, then greater), so equal probabilities come out in
// torch's order. Only rows with a tie or a NaN need that algorithm: without ties every correct
// top-k gives the same answer, so the others take a faster register argmax (`fast_topk`).
// Renormalisation and scaling are compiled without fast-math (true division, no reciprocal).
//
// moe_sort: ids [N] int64 in [0, E) -> order [N] (the stable argsort: indices grouped by
// expert, ascending within an expert) and counts [E] int64. A counting sort, exactly
// torch.argsort(ids, stable=True) and torch.bincount(ids, minlength=E).
//
// Each row is computed alone (batch-invariant). Rows run on OpenMP threads when there are
// enough of them.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRowsPerThread = 64;

using Elem = std::pair<float, int64_t>;

// NaN test on the bits (-ffast-math lets the compiler assume std::isnan is false).
inline bool is_nan(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return (u & 0x7FFFFFFFu) > 0x7F800000u;
}

// torch's comparator for largest=True (NaN sorts first).
inline bool greater(const Elem& x, const Elem& y) {
  return (is_nan(x.first) && !is_nan(y.first)) || (x.first > y.first);
}

// w[0..k) /= sum (slot order), then *= scale; strict IEEE (no reciprocal, no contraction).
__attribute__((optimize("no-fast-math", "fp-contract=off"))) void finish_weights(
    float* w, int64_t k, int renormalize, float scale) {
  if (renormalize) {
    float sum = 0.0f;
    for (int64_t j = 0; j < k; ++j) sum += w[j];
    for (int64_t j = 0; j < k; ++j) w[j] = w[j] / sum;
  }
  if (scale != 1.0f)
    for (int64_t j = 0; j < k; ++j) w[j] = w[j] * scale;
}

#if defined(__AVX512F__)
// k argmax passes over a row of at most NV * 16 probabilities held in NV registers (padded with
// -1, below every probability), branch-free: each pass takes the largest value and its first
// position, then masks it out. One more pass finds the largest left out. Returns false on a tie
// (a chosen value equal to the next chosen or to the largest left out).
template <int NV>
bool argmax_topk(const float* p, float* w, int64_t* ids, int64_t e, int64_t k) {
  __m512 v[NV];
  for (int i = 0; i < NV; ++i) {
    const int64_t left = e - 16 * i;
    const __mmask16 m = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    v[i] = _mm512_mask_loadu_ps(_mm512_set1_ps(-1.0f), m, p + 16 * i);
  }
  float prev = -1.0f;
  for (int64_t pass = 0; pass <= k && pass < e; ++pass) {
    __m512 mx = v[0];
    for (int i = 1; i < NV; ++i) mx = _mm512_max_ps(mx, v[i]);
    const float m = _mm512_reduce_max_ps(mx);
    if (m == prev) return false;
    if (pass == k) break;
    const __m512 vm = _mm512_set1_ps(m);
    uint64_t hits = 0;
    for (int i = 0; i < NV; ++i)
      hits |= uint64_t(_mm512_cmp_ps_mask(v[i], vm, _CMP_EQ_OQ)) << (16 * i);
    const int at = __builtin_ctzll(hits);
    for (int i = 0; i < NV; ++i) {
      const __mmask16 one = __mmask16((uint64_t(1) << at) >> (16 * i));
      v[i] = _mm512_mask_mov_ps(v[i], at >= 16 * i && at < 16 * (i + 1) ? one : 0,
                                _mm512_set1_ps(-1.0f));
    }
    w[pass] = m;
    ids[pass] = at;
    prev = m;
  }
  return true;
}
#endif

// Insertion of (v, j) into the descending list w / ids of n <= k entries.
inline void insert_top(float v, int64_t j, float* w, int64_t* ids, int64_t& n, int64_t k) {
  if (n == k && !(v > w[k - 1])) return;
  int64_t i = n < k ? n++ : k - 1;  // the slot freed (the last one when full)
  for (; i > 0 && w[i - 1] < v; --i) {
    w[i] = w[i - 1];
    ids[i] = ids[i - 1];
  }
  w[i] = v;
  ids[i] = j;
}

// The k largest of p[0..e) (probabilities: >= 0, no NaN) in descending order, into w / ids.
// Returns false, leaving the row to torch's algorithm, when a tie could make the choice or the
// order depend on the algorithm: two chosen values equal, or the k-th equal to a value left
// out. Without ties every correct top-k gives the same answer, torch's included.
// AVX-512 and e <= 64: `argmax_topk` in registers; else insertion.
inline bool fast_topk(const float* p, float* w, int64_t* ids, int64_t e, int64_t k) {
#if defined(__AVX512F__)
  if (e <= 16) return argmax_topk<1>(p, w, ids, e, k);
  if (e <= 32) return argmax_topk<2>(p, w, ids, e, k);
  if (e <= 48) return argmax_topk<3>(p, w, ids, e, k);
  if (e <= 64) return argmax_topk<4>(p, w, ids, e, k);
#endif
  int64_t n = 0;
  for (int64_t j = 0; j < e; ++j) insert_top(p[j], j, w, ids, n, k);
  for (int64_t i = 0; i + 1 < k; ++i)
    if (w[i] == w[i + 1]) return false;
  int64_t equal_to_last = 0;
  for (int64_t j = 0; j < e; ++j) equal_to_last += p[j] == w[k - 1];
  return equal_to_last == 1;
}

void route_row(const float* p, float* w, int64_t* ids, int64_t e, int64_t k, int renormalize,
               float scale, std::vector<Elem>& queue) {
  bool no_nan = true;
  for (int64_t j = 0; j < e; ++j) no_nan &= !is_nan(p[j]);
  if (no_nan && fast_topk(p, w, ids, e, k)) {
    finish_weights(w, k, renormalize, scale);
    return;
  }
  for (int64_t j = 0; j < e; ++j) queue[j] = Elem(p[j], j);
  if (k * 64 <= e) {
    std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), greater);
  } else {
    std::nth_element(queue.begin(), queue.begin() + k - 1, queue.end(), greater);
    std::sort(queue.begin(), queue.begin() + k - 1, greater);
  }
  for (int64_t j = 0; j < k; ++j) {
    w[j] = queue[j].first;
    ids[j] = queue[j].second;
  }
  finish_weights(w, k, renormalize, scale);
}

int topk_renorm(const float* p, float* w, int64_t* ids, int64_t rows, int64_t e, int64_t k,
                int renormalize, float scale, int64_t threads) {
  if (rows < 0 || e <= 0 || k <= 0 || k > e) return 1;
  const int64_t use = rows >= 2 * kRowsPerThread ? threads : 1;
#pragma omp parallel num_threads(use) if (use > 1)
  {
    std::vector<Elem> queue(e);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < rows; ++i)
      route_row(p + i * e, w + i * k, ids + i * k, e, k, renormalize, scale, queue);
  }
  return 0;
}

}  // namespace

extern "C" int batchgen_topk_renorm(const float* p, float* w, int64_t* ids, int64_t rows,
                                    int64_t e, int64_t k, int renormalize, float scale,
                                    int64_t threads) {
  return topk_renorm(p, w, ids, rows, e, k, renormalize, scale, threads);
}

// ids [n] in [0, e) -> order [n], counts [e]. Returns 2 (nothing written to order) when an id
// is out of range.
extern "C" int batchgen_moe_sort(const int64_t* ids, int64_t n, int64_t e, int64_t* order,
                                 int64_t* counts) {
  if (n < 0 || e <= 0) return 1;
  std::memset(counts, 0, sizeof(int64_t) * e);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = ids[i];
    if (id < 0 || id >= e) return 2;
    ++counts[id];
  }
  std::vector<int64_t> next(e);
  int64_t start = 0;
  for (int64_t j = 0; j < e; ++j) {
    next[j] = start;
    start += counts[j];
  }
  for (int64_t i = 0; i < n; ++i) order[next[ids[i]]++] = i;
  return 0;
}
