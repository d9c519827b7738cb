// Read bandwidth of a KV-cache-like access pattern: a 2 GiB float32 buffer read once in blocks
// of B bytes, in order or in a random permutation of the blocks (the layout of a paged KV
// cache whose blocks sit anywhere), summed with AVX-512 on every OpenMP thread, with an
// optional software prefetch of the block PF blocks ahead (`prefetcht1`). The ceiling for
// `batchgen.kernels.paged_attention`'s decode kernel, which reads each sequence's K and V
// blocks once per step (docs/performance.md, "Decode attention against the block-read
// ceiling").
//
//   gcc -O2 -mavx512f -fopenmp benchmarks/block_read_bandwidth.c -o /tmp/block_read_bandwidth
//   OMP_NUM_THREADS=2 /tmp/block_read_bandwidth 8192 2     # B = 8 KiB, prefetch 2 blocks ahead
//
// Prints the best of 5 passes in GB/s for the in-order and the random block order.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s BLOCK_BYTES PREFETCH_BLOCKS (BLOCK_BYTES a multiple of 256)\n",
            argv[0]);
    return 2;
  }
  const size_t total = (size_t)2 << 30;
  const long block = atol(argv[1]), pf = atol(argv[2]);
  if (block < 256 || block % 256 != 0 || pf < 0) {
    fprintf(stderr, "BLOCK_BYTES must be a positive multiple of 256, PREFETCH_BLOCKS >= 0\n");
    return 2;
  }
  float* x = aligned_alloc(64, total);
  for (size_t i = 0; i < total / 4; i++) x[i] = 1.0f;
  const size_t nb = total / block;
  int64_t* order = malloc(nb * sizeof(int64_t));
  for (size_t i = 0; i < nb; i++) order[i] = i;
  srand(1);
  for (size_t i = nb - 1; i > 0; i--) {  // Fisher-Yates
    size_t j = rand() % (i + 1);
    int64_t t = order[i];
    order[i] = order[j];
    order[j] = t;
  }
  for (int random = 0; random < 2; random++) {
    double best = 1e30;
    float check = 0;
    for (int pass = 0; pass < 5; pass++) {
      const double t0 = omp_get_wtime();
      float tot = 0;
#pragma omp parallel for reduction(+ : tot) schedule(static)
      for (size_t b = 0; b < nb; b++) {
        const float* p = x + (random ? order[b] : (int64_t)b) * (block / 4);
        if (pf && b + pf < nb) {
          const char* q = (const char*)(x + (random ? order[b + pf] : (int64_t)(b + pf)) * (block / 4));
          for (long o = 0; o < block; o += 64) _mm_prefetch(q + o, _MM_HINT_T1);
        }
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (long i = 0; i < block / 4; i += 64) {
          a0 = _mm512_add_ps(a0, _mm512_load_ps(p + i));
          a1 = _mm512_add_ps(a1, _mm512_load_ps(p + i + 16));
          a2 = _mm512_add_ps(a2, _mm512_load_ps(p + i + 32));
          a3 = _mm512_add_ps(a3, _mm512_load_ps(p + i + 48));
        }
        tot += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
      }
      const double t = omp_get_wtime() - t0;
      if (t < best) best = t;
      check = tot;
    }
    printf("block %ld B, prefetch %ld, %s: %.1f GB/s (sum %.0f)\n", block, pf,
           random ? "random order" : "in order", total / best / 1e9, check);
  }
  free(order);
  free(x);
  return 0;
}
