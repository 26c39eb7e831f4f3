"""flash-qla: Gated DeltaNet (gated delta rule) kernels for NVIDIA Hopper, written in TileLang."""

from .api import (
    forward_backend,
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_bwd,
    chunk_gated_delta_rule_fwd,
    fused_recurrent_gated_delta_rule,
    fused_recurrent_gated_delta_rule_fwd,
)

__version__ = "0.1.0"

__all__ = [
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_fwd",
    "chunk_gated_delta_rule_bwd",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_gated_delta_rule_fwd",
    "forward_backend",
]
