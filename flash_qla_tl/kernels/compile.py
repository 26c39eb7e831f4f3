"""Compile TileLang programs for Hopper, once per static config, cached on disk; or load them shipped.

Kernels are factories: ``build(config) -> PrimFunc`` with sequence lengths left
symbolic, so one compiled binary serves every length.  A program comes from the
first of:

1. the programs shipped compiled with an arch-specific build of the package
   (``shipped.py``): no TileLang, no nvcc, nothing compiled;
2. TileLang, which lowers and builds it at first use (a log line says so and how
   long it took) and keeps it in its disk cache (``TILELANG_CACHE_DIR``), so that
   a second process loads it instead (BENCHMARKS.md, "Cold start": 21.4 s against
   2.22 s for a first call on an H200).

Without either, :class:`KernelsUnavailable`; the launchers' callers check
:func:`kernels_available` first and take the PyTorch path instead.
The target is explicit, so the same cubins build on a machine without a GPU.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import re
import time
import warnings
from typing import Callable

from . import shipped

HOPPER_TARGET = {"kind": "cuda", "arch": "sm_90a"}
# nvcc --use_fast_math: exp2 becomes one ex2.approx.ftz (the precise exp2f adds a
# denormal range check and a branch per call, which showed in the forward's gate
# loops) and rsqrt one rsqrt.approx; both are within a few fp32 ulps, and a gate
# flushed below 2^-126 is a decay to zero either way.
DEFAULT_PASS_CONFIGS = {"tl.enable_fast_math": True}

logger = logging.getLogger("flash_qla")


class KernelsUnavailable(RuntimeError):
    """A program is neither shipped with this build nor compilable here (TileLang is not installed)."""


@functools.lru_cache(maxsize=None)
def tilelang_importable() -> bool:
    try:
        import tilelang  # noqa: F401
    except ImportError:
        return False
    return True


def kernels_available(num_qk_heads: int, num_v_heads: int, dtype: str, sms: int) -> bool:
    """Whether the programs of this head config and dtype can be had on a GPU of ``sms`` SMs: shipped, or
    compiled by TileLang."""
    return shipped.covers_head_config(num_qk_heads, num_v_heads, dtype, sms) or tilelang_importable()


@functools.lru_cache(maxsize=None)
def program_available(build: Callable, *config) -> bool:
    """Whether one program can be had (the layer's small kernels, which are keyed by their own configs)."""
    return shipped.has_program(program_key(build, config, pass_configs_of(build))) or tilelang_importable()


def pass_configs_of(build: Callable, pass_configs: dict | None = None) -> tuple:
    """Every TileLang option a program is compiled with: the defaults, the factory's
    ``build.pass_configs`` (options its kernel needs, whoever compiles it), then ``pass_configs``."""
    configs = {**DEFAULT_PASS_CONFIGS, **getattr(build, "pass_configs", {}), **(pass_configs or {})}
    return tuple(sorted(configs.items()))


def program_key(build: Callable, config: tuple, pass_configs: tuple) -> str:
    """What names one compiled program (the shipped index's key): its factory, its static config with the
    factory's defaults filled in (a launcher may leave them out), and its options."""
    bound = inspect.signature(build).bind(*config)
    bound.apply_defaults()
    return f"{build.__name__}{tuple(bound.arguments.values())!r} {dict(pass_configs)!r}"


@functools.lru_cache(maxsize=None)
def warn_unavailable(reason: str) -> None:
    """Say once per reason that a Hopper GPU runs the PyTorch path because no kernels can be had."""
    warnings.warn(f"flash-qla: {reason}; running the PyTorch path instead (much slower). Install apache-tvm-ffi "
                  "and use a build that ships kernels for this config, or install tilelang to compile them.",
                  RuntimeWarning, stacklevel=3)


def compile_program(build: Callable, *config, pass_configs: dict | None = None):
    """The program ``build(*config)`` for sm_90a: shipped, or compiled (cached in memory and on disk)."""
    return _program(build, tuple(config), pass_configs_of(build, pass_configs))


def _ensure_cuda_home() -> None:
    if "CUDA_HOME" not in os.environ and os.path.isdir("/usr/local/cuda"):
        os.environ["CUDA_HOME"] = "/usr/local/cuda"


@functools.lru_cache(maxsize=None)
def _program(build: Callable, config: tuple, pass_configs: tuple):
    key = program_key(build, config, pass_configs)
    program = shipped.load_program(key)
    if program is not None:
        return program
    if not tilelang_importable():
        raise KernelsUnavailable(f"{key} is not shipped with this build and TileLang is not installed to compile it")
    return compile_with_tilelang(build, config, pass_configs)


def compile_with_tilelang(build: Callable, config: tuple, pass_configs: tuple):
    """Lower and build one program with TileLang (or load it from TileLang's disk cache)."""
    _ensure_cuda_home()
    import tilelang  # lazy: CPU-only users and shipped builds never import it

    start = time.perf_counter()
    program = tilelang.compile(build(*config), target=HOPPER_TARGET, execution_backend="tvm_ffi",
                               pass_configs=dict(pass_configs))
    if shipped.index()["programs"]:  # a shipped build that lacks this program: say what it costs
        logger.warning("flash-qla: %s(%s) is not among the shipped kernels; TileLang compiled it (or loaded its "
                       "disk cache) in %.1f s", build.__name__, ", ".join(map(repr, config)),
                       time.perf_counter() - start)
    else:
        logger.info("flash-qla: TileLang compiled %s in %.1f s", build.__name__, time.perf_counter() - start)
    check_named_barriers(program.get_kernel_source(), build.__name__)
    return program


def check_named_barriers(source: str, name: str) -> None:
    """Every named barrier of a program synchronises one thread count.

    TileLang gives the partial syncs it inserts ids of its own, from 3 upwards, beside the ids a kernel
    names (``T.sync_threads(id, count)``); two thread ranges meeting at one id with different counts is
    an illegal instruction on the GPU, or a hang, and only under load (a 128-thread and a 256-thread
    range at id 3 ran clean on 16 programs and stopped 128).  Checked here, where it costs a compile.
    """
    counts = {}
    for barrier, count in re.findall(r"__sync_thread_partial\((\d+), (\d+)\)", source):
        counts.setdefault(int(barrier), set()).add(int(count))
    shared = {barrier: sorted(c) for barrier, c in counts.items() if len(c) > 1}
    if shared:
        raise RuntimeError(f"{name}: named barriers synchronise different thread counts {shared} (TileLang's "
                           "own ids start at 3; a kernel's own go above them: chunk_pipeline.CHAIN_BARRIER)")
