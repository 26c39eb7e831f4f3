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
  return (run<true>(late_cycles) + run<false>(late_cycles)) ? 1 : 0;
}
