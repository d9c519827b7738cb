// Shared by the fused MoE driver (fused_moe.cpp), its micro-kernel headers (fused_moe_f32.h,
// fused_moe_bf16.h, fused_moe_amx.h, amx_bf16.h) and the dense packed_linear.cpp.
//
// A micro-kernel is a struct with:
//   In         the activation and weight element type (float, or uint16_t holding bf16 bits);
//   kMR        the row block the activation buffer is rounded up to;
//   kRowChunk  rows per gather chunk (a multiple of kMR);
//   kStep      32-bit words between consecutive k (float32) or k pairs (bf16) of one row in the
//              activation buffer, and row_offset(row, k_size): where a row's k = 0 starts (In
//              elements): the driver gathers rows and writes the activation through these;
//   kZeroPadRows  whether gemm reads the rows from m up to the next multiple of kMR (the
//              driver zeroes them);
//   kFusedSilu whether the kernel has gemm_silu(a, m, k_size, w13_packed, inter, act): the
//              gate/up GEMM with the SiLU-gated activation written in its epilogue (else the
//              driver runs gemm into float32 rows and the activation as a pass of its own);
//   gemm(a, m, k_size, packed, n, c_rows, scale): c_rows[r][0 : n] = scale[r] * (A[r] . W^T)
//              for r < m (scale null: 1), W packed in 16-column panels (fused_moe.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

// The bf16 kernels need a compiler that knows AVX512-BF16 (GCC 10, clang 9) and x86-64; AMX
// (tile intrinsics usable under a target attribute) needs GCC 11 or clang 12.
#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 9) || \
                            (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10))
#define BATCHGEN_HAVE_BF16 1
#else
#define BATCHGEN_HAVE_BF16 0
#endif
#if defined(__x86_64__) && defined(__linux__) &&                  \
    ((defined(__clang__) && __clang_major__ >= 12) ||             \
     (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define BATCHGEN_HAVE_AMX 1
#else
#define BATCHGEN_HAVE_AMX 0
#endif

namespace {

constexpr int64_t kPanel = 16;  // output columns per packed panel

// y_slots (T x top-k x H float32) above this size is written with non-temporal stores by the
// bf16 kernels: a buffer that outgrows a core's L2 (2 MiB here) and more would evict the
// weights and activations the GEMMs reuse, while a smaller one is read back from the caches
// by the slot sum. 4 MiB: 256 tokens of the bench layer (top-8, H 512) still use regular
// stores (measured faster at 128 and 256 tokens, slower at 512: fused_moe_amx.h).
constexpr int64_t kStreamMinBytes = int64_t{4} << 20;

// Software prefetch of the weight panels a micro-kernel streams, for the first row block of a
// panel (later row blocks find it in the caches): at decode (a few rows per expert) every
// panel is read once per step from memory by a micro-kernel whose FMAs leave the loads
// waiting, and the hardware streamer stops at every 4 KiB page. Per CPU vendor, chosen at run
// time (`cpu_weight_prefetch`; never per row count, so a row's bits do not depend on it):
//   kL1Near: 2 KiB ahead into L1 (_MM_HINT_T0), the choice measured on an Intel AMX machine
//            (Avx512F32::gemm's note); Intel keeps it.
//   kL2Far:  4 KiB ahead into L2 (_MM_HINT_T1) on AMD. Zen 4 (2 cores, L2 1 MiB), bench layer,
//            one thread, process CPU time, against the Intel choice: float32 0.78-0.84 of
//            the time at 16 and 70 tokens, 0.92 at 160, 0.98 at 512 (T0 into L1 at 1, 2 or
//            4 KiB: 0.83-1.01; none: 0.79-1.06; T1 at 3/6/8 KiB: close, 4 KiB best); the
//            vdpbf16ps kernel (no prefetch before) 0.88, 0.80 and 0.90 at 16, 70, 160 (T0 at
//            2 KiB: 1.12, 1.05, 0.95). The numbers and commands: docs/performance.md.
//   kNone:   no software prefetch.
enum class WeightPrefetch { kNone, kL1Near, kL2Far };

// kL2Far on AMD CPUs, else `other` (the kernel's choice elsewhere).
inline WeightPrefetch cpu_weight_prefetch(WeightPrefetch other) {
#if defined(__x86_64__)
  static const bool amd = (__builtin_cpu_init(), __builtin_cpu_is("amd"));
  return amd ? WeightPrefetch::kL2Far : other;
#else
  return other;
#endif
}

// Prefetches the weight line `ahead` of the one at `line`, as P says (kNone: nothing).
template <WeightPrefetch P>
inline void prefetch_weights(const void* line) {
#if defined(__x86_64__)
  const char* p = static_cast<const char*>(line);
  if constexpr (P == WeightPrefetch::kL1Near) _mm_prefetch(p + 2048, _MM_HINT_T0);
  if constexpr (P == WeightPrefetch::kL2Far) _mm_prefetch(p + 4096, _MM_HINT_T1);
#else
  (void)line;
#endif
}

// A std::vector allocator aligned to cache lines. The bf16 kernels' scratch (the gathered
// rows, the activation) is read by AMX tile loads, 64 bytes per row: from a buffer malloc
// aligned to 16 bytes (a 128 KiB vector is mmap'ed at a page + 16) every row of every tile
// load spans two cache lines. In a GEMM-only test (m 128, K 512, N 512, 64 experts) A 16 bytes
// off ran at 815 GFLOP/s against 944 aligned.
template <class T>
struct CacheAligned {
  using value_type = T;
  static constexpr std::align_val_t kAlign{64};
  CacheAligned() = default;
  template <class U>
  CacheAligned(const CacheAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlign)); }
  void deallocate(T* p, size_t) { ::operator delete(p, kAlign); }
  template <class U>
  bool operator==(const CacheAligned<U>&) const { return true; }
  template <class U>
  bool operator!=(const CacheAligned<U>&) const { return false; }
};

// Tail dispatch: calls F::template run<R>(args...) for R = rem (1 <= rem < MR).
template <class F, int MR, int R = 1, class... Args>
inline void dispatch_rows(int64_t rem, Args... args) {
  if constexpr (R < MR) {
    if (rem == R) {
      F::template run<R>(args...);
      return;
    }
    dispatch_rows<F, MR, R + 1>(rem, args...);
  }
}

// float32 -> bf16 bits, round to nearest even (finite inputs; the kernels see no NaN).
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Activations go into micro-panels, not row-major rows: block b holds rows MR*b..MR*b+MR-1
// stored k-major ([K][MR]; bf16: [K / 2][MR][2]), so the micro-kernel's broadcasts read one
// sequential stream instead of MR rows K apart (BLIS packs A the same way). The gather and the
// SiLU write this layout directly. Measured for the AVX2 kernel with
// `benchmarks/moe_layer.py --rounds 3` against row-major rows (E 64, top-8, H 512, I 256, 2
// threads): 64 tokens 9.9-10.6 ms vs 11.7-12.6, 512 tokens 32.5-36.3 vs 45.2-46.5.
// kPerWord: k per 32-bit word (1 float32, 2 bf16).
template <int MR, int kPerWord>
struct MicroPanelLayout {
  static constexpr int kMR = MR;
  static constexpr int64_t kRowChunk = 120;  // 120 x 512 floats = 240 KiB (L2)
  static constexpr int64_t kStep = MR;
  static constexpr bool kZeroPadRows = false;  // row tails run narrower micro-kernels
  static constexpr bool kFusedSilu = false;
  static int64_t row_offset(int64_t row, int64_t k_size) {
    return (row / MR) * k_size * MR + (row % MR) * kPerWord;
  }
};

}  // namespace
