// Where the hardware places the CTAs of cluster launches, the fact behind the dense MMA kernel's split rule: for
// grids of cps x s CTAs in clusters of s (cps = CTA columns per split, s = K splits), with dynamic shared memory
// sized for 1, 3, 4, 5 or 10 CTAs per SM, how many SMs the grid lands on and the most CTAs one SM gets. Every CTA spins
// ~11 us so that all CTAs that fit are resident together; a time past ~20 us means a second wave.
//
//   nvcc -O2 -arch=sm_90a -o cluster_placement benchmarks/probes/cluster_placement.cu && ./cluster_placement
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>

__global__ void probe(int* smid_out, long long spin) {
  extern __shared__ char buf[];
  unsigned smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  long long t0 = clock64();
  while (clock64() - t0 < spin) {}
  buf[threadIdx.x] = 1;  // touches the shared memory, so the launch keeps its size
  if (threadIdx.x == 0) smid_out[blockIdx.x] = smid + 1000 * (buf[0] == 7);  // (never 7: smid as read)
}

int main() {
  int nsm; cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0);
  cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
  cudaFuncSetAttribute(probe, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  int* d; cudaMalloc(&d, 4096 * sizeof(int));
  const int smems[] = {150 * 1024, 42 * 1024, 50 * 1024, 62 * 1024, 20 * 1024};
  const int cpss[] = {8, 32, 64, 80, 160};
  for (int smem : smems) {
    int per_sm = 0; cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, probe, 128, smem);
    for (int cps : cpss) {
      for (int s = 1; s <= 8; ++s) {
        const int ctas = cps * s;
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(ctas); cfg.blockDim = dim3(128); cfg.dynamicSmemBytes = smem;
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim.x = s; attr[0].val.clusterDim.y = 1; attr[0].val.clusterDim.z = 1;
        cfg.attrs = attr; cfg.numAttrs = 1;
        int clusters = 0; cudaOccupancyMaxActiveClusters(&clusters, probe, &cfg);
        cudaMemset(d, 0xff, 4096 * sizeof(int));
        cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
        cudaEventRecord(a);
        cudaError_t e = cudaLaunchKernelEx(&cfg, probe, d, 20000LL);  // ~11 us at 1.8 GHz
        cudaEventRecord(b); cudaEventSynchronize(b);
        float ms = 0; cudaEventElapsedTime(&ms, a, b);
        std::vector<int> h(ctas); cudaMemcpy(h.data(), d, ctas * sizeof(int), cudaMemcpyDeviceToHost);
        std::vector<int> cnt(nsm, 0);
        for (int v : h) if (v >= 0 && v < nsm) cnt[v]++;
        int used = 0, mx = 0; for (int c : cnt) { used += c > 0; mx = std::max(mx, c); }
        // SMs shared by CTAs of one cluster: how many distinct SMs the first cluster spans
        std::vector<int> first(h.begin(), h.begin() + s); std::sort(first.begin(), first.end());
        int span = std::unique(first.begin(), first.end()) - first.begin();
        printf("smem=%dK per_sm=%d cps=%d s=%d ctas=%d maxclusters=%d err=%d time_us=%.1f sms_used=%d max_per_sm=%d cluster0_span=%d\n",
               smem / 1024, per_sm, cps, s, ctas, clusters, (int)e, ms * 1000, used, mx, span);
      }
    }
  }
  return 0;
}
