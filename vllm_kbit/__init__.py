"""vllm-kbit: k-bit (k = 2..5) normal-float weight quantization for vLLM, with fused CUDA kernels."""

from vllm_kbit import reference
from vllm_kbit.linear import KbitLinearWeight, kbit_linear
from vllm_kbit.ops import HAS_CUDA_KERNELS
from vllm_kbit import moe  # noqa: F401  (kbit::fused_moe's implementations; moe uses ops, ops does not import moe)
from vllm_kbit.weight import KbitWeight, quantize

__all__ = ["HAS_CUDA_KERNELS", "KbitLinearWeight", "KbitWeight", "kbit_linear", "quantize", "reference"]
__version__ = "0.1.0"
