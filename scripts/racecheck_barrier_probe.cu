// Does compute-sanitizer's racecheck see a 256-thread barrier between a shared-memory
// store and another warp's read of it?  (issue 14, notes/backward-racecheck.md)
//
// racecheck reports RAW hazards in chunk_local_gradients between a store and a read that
// the compiled code separates by one block-wide barrier (`bar.sync 2, 256` in TileLang's
// AllReduce, or `__syncthreads`), and its sync trace shows the writer's warp not yet at
// that barrier when it reports.  This kernel is that pattern and nothing else: each round,
// every thread stores s[t], all 256 threads pass a barrier, and each reads s[t ^ 128]
// (the other warpgroup's value).  One warp per round is made late before its store, so the
// others wait at the barrier for it.  The program is correct by construction and checks
// its results on the host; a hazard reported here is the tool's, not a race.
//
// A third kernel is the pattern racecheck reports in the persistent local kernel since
// 2026-11-25 (notes/backward-budget.md item 14): three 128-thread warpgroups, each with a
// named barrier of its own (`bar.sync id, 128`); in one of them some threads store (the
// padding rows a short chunk zeroes), the warpgroup passes its barrier, and other warps
// read what they stored.
//
//   nvcc -arch=sm_90a -lineinfo -O3 -o probe scripts/racecheck_barrier_probe.cu
//   ./probe 20000 && compute-sanitizer --tool racecheck ./probe 20000
#include <cstdio>
#include <cstdlib>

// A named barrier over the whole 256-thread block, as TileLang's NamedBarrier<256> emits it.
#define NAMED_BARRIER(id) asm volatile("bar.sync %0, 256;" ::"n"(id) : "memory")

constexpr int kThreads = 256, kBlocks = 264, kRounds = 8;
constexpr int kSharedBytes = 200 * 1024;  // a large dynamic window, as the real kernel's

__device__ void spin(long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

// kNamed: ids 1 and 2 as in the AllReduce; otherwise __syncthreads.
template <bool kNamed>
__global__ void __launch_bounds__(kThreads, 1) exchange(float* out, int late_cycles) {
  extern __shared__ float s[];
  int t = threadIdx.x, warp = t >> 5;
  float x = t;
  for (int r = 0; r < kRounds; r++) {
    __syncthreads();  // the previous round's reads are done before anyone stores again
    if (kNamed) NAMED_BARRIER(1); else __syncthreads();
    if (late_cycles && warp == ((r + blockIdx.x) & 7)) spin(late_cycles);
    s[t] = x;
    if (kNamed) NAMED_BARRIER(2); else __syncthreads();
    x = (x + s[t ^ 128]) * 0.5f;
  }
  out[blockIdx.x * kThreads + t] = x;
}

// Three warpgroups of 128 threads, barrier ids 8, 9 and 10 (the local kernel's roles use 8 and
// TileLang's syncs 3-6).  Each round, in every warpgroup, the threads of the upper half of
// the warpgroup's rows (as a short chunk's rows past n) store, the warpgroup syncs, and every
// thread reads the value a thread of another warp stored.
constexpr int kGroupThreads = 128, kGroups = 3;

__global__ void __launch_bounds__(kGroupThreads * kGroups, 1) exchange_in_groups(float* out, int late_cycles) {
  extern __shared__ float s[];
  int t = threadIdx.x, group = t / kGroupThreads, g = t % kGroupThreads, warp = g >> 5;
  float* mine = s + group * kGroupThreads;
  float x = t;
  for (int r = 0; r < kRounds; r++) {
    // the previous round's reads are done before anyone of the group stores again
    asm volatile("bar.sync %0, %1;" ::"r"(8 + group), "n"(kGroupThreads) : "memory");
    if (late_cycles && warp == ((r + blockIdx.x) & 3)) spin(late_cycles);
    if (g >= kGroupThreads / 2) mine[g] = x;
    asm volatile("bar.sync %0, %1;" ::"r"(8 + group), "n"(kGroupThreads) : "memory");
    x = (x + mine[kGroupThreads / 2 + (g + 32) % (kGroupThreads / 2)]) * 0.5f;
  }
  out[blockIdx.x * kGroupThreads * kGroups + t] = x;
}

int run_groups(int late_cycles) {
  const int threads = kGroupThreads * kGroups, n = kBlocks * threads;
  float* out;
  cudaMalloc(&out, n * sizeof(float));
  cudaFuncSetAttribute(exchange_in_groups, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes);
  exchange_in_groups<<<kBlocks, threads, kSharedBytes>>>(out, late_cycles);
  float* host = (float*)malloc(n * sizeof(float));
  cudaMemcpy(host, out, n * sizeof(float), cudaMemcpyDeviceToHost);
  int wrong = 0;
  for (int b = 0; b < kBlocks; b++)
    for (int group = 0; group < kGroups; group++) {
      float x[kGroupThreads];  // the group's values, round by round, as the kernel computes them
      for (int g = 0; g < kGroupThreads; g++) x[g] = group * kGroupThreads + g;
      for (int r = 0; r < kRounds; r++) {
        float stored[kGroupThreads / 2], next[kGroupThreads];
        for (int g = kGroupThreads / 2; g < kGroupThreads; g++) stored[g - kGroupThreads / 2] = x[g];
        for (int g = 0; g < kGroupThreads; g++) next[g] = (x[g] + stored[(g + 32) % (kGroupThreads / 2)]) * 0.5f;
        for (int g = 0; g < kGroupThreads; g++) x[g] = next[g];
      }
      for (int g = 0; g < kGroupThreads; g++) wrong += host[b * threads + group * kGroupThreads + g] != x[g];
    }
  printf("128-thread named barriers in 3 warpgroups, late warp %d cycles: %d wrong values, %s\n", late_cycles,
         wrong, cudaGetErrorString(cudaGetLastError()));
  free(host);
  cudaFree(out);
  return wrong;
}

template <bool kNamed>
int run(int late_cycles) {
  float* out;
  cudaMalloc(&out, kBlocks * kThreads * sizeof(float));
  cudaFuncSetAttribute(exchange<kNamed>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes);
  exchange<kNamed><<<kBlocks, kThreads, kSharedBytes>>>(out, late_cycles);
  float* host = (float*)malloc(kBlocks * kThreads * sizeof(float));
  cudaMemcpy(host, out, kBlocks * kThreads * sizeof(float), cudaMemcpyDeviceToHost);
  int wrong = 0;
  for (int b = 0; b < kBlocks; b++)
    for (int t = 0; t < kThreads; t++) {
      float x = t, y = t ^ 128;  // the pair's two values stay equal after the first round
      for (int r = 0; r < kRounds; r++) x = y = (x + y) * 0.5f;
      wrong += host[b * kThreads + t] != x;
    }
  printf("%s barriers, late warp %d cycles: %d wrong values, %s\n", kNamed ? "named" : "__syncthreads",
         late_cycles, wrong, cudaGetErrorString(cudaGetLastError()));
  free(host);
  cudaFree(out);
  return wrong;
}

int main(int argc, char** argv) {
  int late_cycles = argc > 1 ? atoi(argv[1]) : 0;
  return (run<true>(late_cycles) + run<false>(late_cycles) + run_groups(late_cycles)) ? 1 : 0;
}
