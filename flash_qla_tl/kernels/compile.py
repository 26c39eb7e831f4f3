"""Compile TileLang programs for Hopper, once per static config, cached on disk.

Kernels are factories: ``build(config) -> PrimFunc`` with sequence lengths left
symbolic, so one compiled binary serves every length.  The first call for a
config lowers and builds it; TileLang's disk cache (``TILELANG_CACHE_DIR``) lets
a second process load it instead (BENCHMARKS.md, "Cold start": 21.4 s against
2.22 s for a first call on an H200).
The target is explicit, so the same cubins build on a machine without a GPU.
"""

from __future__ import annotations

import functools
import os
from typing import Callable

HOPPER_TARGET = {"kind": "cuda", "arch": "sm_90a"}
# nvcc --use_fast_math: exp2 becomes one ex2.approx.ftz (the precise exp2f adds a
# denormal range check and a branch per call, which showed in the forward's gate
# loops) and rsqrt one rsqrt.approx; both are within a few fp32 ulps, and a gate
# flushed below 2^-126 is a decay to zero either way.
DEFAULT_PASS_CONFIGS = {"tl.enable_fast_math": True}


def _ensure_cuda_home() -> None:
    if "CUDA_HOME" not in os.environ and os.path.isdir("/usr/local/cuda"):
        os.environ["CUDA_HOME"] = "/usr/local/cuda"


def compile_program(build: Callable, *config, pass_configs: dict | None = None):
    """Lower ``build(*config)`` and compile it for sm_90a (cached in memory and on disk).

    A factory may carry its own ``build.pass_configs`` (TileLang options its kernel
    needs, whoever compiles it); ``pass_configs`` adds to them.
    """
    configs = {**getattr(build, "pass_configs", {}), **(pass_configs or {})}
    return _compile_cached(build, tuple(config), tuple(sorted(configs.items())))


@functools.lru_cache(maxsize=None)
def _compile_cached(build: Callable, config: tuple, pass_configs: tuple):
    _ensure_cuda_home()
    import tilelang  # lazy: CPU-only users and the hub's build sandbox never import it

    return tilelang.compile(
        build(*config),
        target=HOPPER_TARGET,
        execution_backend="tvm_ffi",
        pass_configs={**DEFAULT_PASS_CONFIGS, **dict(pass_configs)},
    )
