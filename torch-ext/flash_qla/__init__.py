"""flash-qla on the Hugging Face kernel hub: Gated DeltaNet (gated delta rule) kernels.

    from kernels import get_kernel
    flash_qla = get_kernel("qwen/flash-qla", version=1)
    o, state = flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    flash_qla.kernelize_qwen3_5(model)  # every GatedDeltaNet layer of a Qwen3.5 / 3.6 model

The operators follow FLA's conventions and run on CPU through the library's
PyTorch path.  TileLang is imported only when a GPU kernel is first needed.
"""

from . import layers
from .mapping import kernel_mapping, kernelize_qwen3_5, register_kernel_mapping
from .ops import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

__all__ = [
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "kernel_mapping",
    "kernelize_qwen3_5",
    "layers",
    "register_kernel_mapping",
]
