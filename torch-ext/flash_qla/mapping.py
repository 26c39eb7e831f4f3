"""Kernel mapping from Transformers' Qwen3.5 / Qwen3.6 hooks to this package's layers.

`kernels` is imported inside the functions: the package itself must import
without it (the hub's build sandbox imports it bare).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

REPO_ID = "qwen/flash-qla"
VERSION = 1

# This copy of the package, as loaded by `get_kernel` (its variant directory):
# the helpers below map to it, so kernelizing needs no second resolution and
# works offline.  Not resolved: `kernels` caches loaded variants by this path.
PACKAGE_DIR = Path(__file__).parent

# Transformers' hook name -> layer class in layers.py.  The module layer covers
# dense and MoE models (both register as `Qwen3_5GatedDeltaNet`); the function
# hooks serve models that keep Transformers' layer and only swap the operator.
LAYERS = {
    "Qwen3_5GatedDeltaNet": "Qwen3_5GatedDeltaNet",
    "chunk_gated_delta_rule": "ChunkGatedDeltaRule",
    "fused_recurrent_gated_delta_rule": "FusedRecurrentGatedDeltaRule",
}

# The TileLang programs are built for sm_90a (H100, H200); on other GPUs
# kernelize keeps Transformers' layers.
HOPPER_CAPABILITY = 90


def kernel_mapping(device: str = "cuda", repo_path: Path | str | None = None) -> dict:
    """The mapping for `kernels.register_kernel_mapping` / `kernels.use_kernel_mapping`.

    Args:
        device: "cuda" maps for compute capability 9.0 only; "cpu" maps to the
            library's pure-PyTorch path (tests, CPU-only machines).
        repo_path: a local build (a repository with build/, or a variant
            directory) instead of the Hub repository `qwen/flash-qla`, version 1.
    """
    from kernels import CUDAProperties, Device, LayerRepository, LocalLayerRepository

    if device == "cuda":
        target = Device(type="cuda", properties=CUDAProperties(
            min_capability=HOPPER_CAPABILITY, max_capability=HOPPER_CAPABILITY))
    else:
        target = Device(type=device)

    def repository(layer_name: str):
        if repo_path is None:
            return LayerRepository(REPO_ID, layer_name=layer_name, version=VERSION)
        return LocalLayerRepository(Path(repo_path), layer_name=layer_name)

    return {hook: {target: repository(layer)} for hook, layer in LAYERS.items()}


def register_kernel_mapping(device: str = "cuda") -> None:
    """Register the mapping to this loaded package globally, for later `kernels.kernelize` calls."""
    import kernels

    kernels.register_kernel_mapping(kernel_mapping(device, PACKAGE_DIR))


def kernelize_qwen3_5(model, mode=None):
    """Swap flash-qla into every GatedDeltaNet layer of a Qwen3.5 / Qwen3.6 model (dense or MoE).

    The device comes from the model's parameters; `mode` defaults to
    `Mode.TRAINING` for a model in training mode, else `Mode.INFERENCE` (add
    `Mode.TORCH_COMPILE` as needed).  Layers without a matching mapping (e.g. a
    GPU that is not sm_90) keep Transformers' forward.  Returns the model.
    """
    from kernels import Mode, kernelize, use_kernel_mapping

    device = next(model.parameters()).device.type
    if mode is None:
        mode = Mode.TRAINING if model.training else Mode.INFERENCE
    with use_kernel_mapping(kernel_mapping(device, PACKAGE_DIR)), _quiet_unmapped_layer_warnings():
        return kernelize(model, mode=mode, device=device)


@contextlib.contextmanager
def _quiet_unmapped_layer_warnings():
    # kernelize warns for every hub-extensible layer it has no mapping for
    # (norms, convolutions, ...).  This helper maps only the GatedDeltaNet
    # hooks, so those warnings are expected here.
    logger = logging.getLogger("kernels.layer.layer")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
