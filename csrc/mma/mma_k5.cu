// kbit fused dequant + MMA: the k=5 instances (one file per k, so they compile in parallel).
#include "mma_kernel.cuh"

namespace kbit {
namespace mma_detail {
template void launch_mma_k<5>(const MmaLaunch&, bool);
template MmaInstanceFacts mma_facts_k<5>(int, int, bool, bool, int);
}  // namespace mma_detail
}  // namespace kbit
