"""Fill TileLang's disk cache (``TILELANG_CACHE_DIR``) with the kernels, no GPU needed.

    python scripts/precompile.py                          # the Qwen3.5 head configs, bf16, state in and out
    python scripts/precompile.py --heads 16x32 --dtypes float16 --all-flags --kernels forward,backward --jobs 8
    python scripts/precompile.py --heads 16x32,16x64,2x8 --kernels decode --jobs 8

The cache is keyed by the program, the target (sm_90a) and the TileLang version,
so a cache filled here is reused on a Hopper machine with the same tilelang:
the first call there loads instead of compiling.  ``--jobs`` compiles in that
many processes (each program compiles on one core).  ``--cache-list FILE`` adds
the cache directories of the listed programs (relative to the cache root) to
FILE, so that exactly those travel to the device (a cache of many revisions is
far more than a call carries; file times cannot tell which entries a revision
uses):  ``tar -C "$TILELANG_CACHE_DIR" -cJf .gpu/tlcache.tar.xz -T FILE``.
"""

import argparse
import functools
import itertools
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flash_qla_tl.hopper_backward import SCORES_WIDTHS, WALK_WIDEST  # noqa: E402
from flash_qla_tl.hopper_forward import StatePassPlan, value_correction  # noqa: E402
from flash_qla_tl.kernels.causal_conv_step import build_causal_conv_step  # noqa: E402
from flash_qla_tl.kernels.chunk_forward import build_chunk_forward  # noqa: E402
from flash_qla_tl.kernels.chunk_local_gradients import build_chunk_local_gradients  # noqa: E402
from flash_qla_tl.kernels.chunk_prep import build_chunk_prep  # noqa: E402
from flash_qla_tl.kernels.chunk_scores import build_chunk_scores  # noqa: E402
from flash_qla_tl.kernels.compile import compile_program  # noqa: E402
from flash_qla_tl.kernels.gated_rms_norm import build_gated_rms_norm  # noqa: E402
from flash_qla_tl.kernels.inverse_norms import build_inverse_norms  # noqa: E402
from flash_qla_tl.kernels.recurrent_step import BLOCK_WIDTHS as DECODE_WIDTHS  # noqa: E402
from flash_qla_tl.kernels.recurrent_step import RecurrentStepConfig, build_recurrent_step  # noqa: E402
from flash_qla_tl.kernels.reverse_state_pass import build_reverse_state_pass  # noqa: E402
from flash_qla_tl.kernels.segment_scan import build_segment_scan  # noqa: E402
from flash_qla_tl.kernels.sequence_pieces import CHUNK_ROWS, SEGMENT_STARTS, build_sequence_pieces  # noqa: E402
from flash_qla_tl.kernels.zero_tail_rows import build_zero_tail_rows  # noqa: E402

HOPPER_SMS = 132  # H100 SXM and H200: the persistent local-gradient programs are built per SM count
QWEN_HEADS = "2x8,4x16,8x32,16x64,16x32,16x48,16x16,32x32"


def programs(hqk, hv, dtype, widths, all_flags, kernels):
    """Every (factory, config) one head config needs, as the launchers ask for them."""
    flags = list(itertools.product([True, False], repeat=2)) if all_flags else [(True, True)]
    out = []
    if "decode" in kernels:
        # g and beta as Transformers passes them (fp32, bf16) and both fp32; the layer's step (gates in kernel,
        # from its a, b and its A_log, dt_bias in the model's dtype)
        gates = [("float32", "bfloat16", False), ("float32", "float32", False), (dtype, dtype, True)]
        out += [(build_recurrent_step, (RecurrentStepConfig(
                    hqk, hv, dtype, g, beta, b, l2norm, h0, ht, varlen, gate_in_kernel=in_kernel,
                    beta_sigmoid_in_kernel=in_kernel, param_dtype=dtype if in_kernel else "float32"),))
                for (g, beta, in_kernel), b, l2norm, (h0, ht), varlen in itertools.product(
                    gates, DECODE_WIDTHS, [True, False], flags, [False, True])
                if not in_kernel or (l2norm and not varlen)]
        # the layer's conv step (Qwen3.5's conv1d has no bias) and gated RMSNorm
        out += [(build_causal_conv_step, ((2 * hqk + hv) * 128, 4, dtype, False, True)),
                (build_gated_rms_norm, (128, dtype))]
    if "forward" not in kernels and "backward" not in kernels:
        return out
    # chunk_prep: (store_inverse, store_keys) of the forward's plans and of the backward, each with and
    # without the keys' norms (the l2norm)
    preps = [(False, False), (False, True)] + ([(True, True)] if "backward" in kernels else [])
    out += [(build_chunk_prep, (hqk, hv, 128, dtype, inverse, keys, l2norm))
            for (inverse, keys), l2norm in itertools.product(preps, (True, False))]
    out += [(build_inverse_norms, (hqk, 128, dtype)), (build_zero_tail_rows, (hv * 128, dtype)),
            (build_sequence_pieces, (CHUNK_ROWS,)), (build_sequence_pieces, (SEGMENT_STARTS,))]
    # the state pass's value correction, per width, for one pass over whole sequences or over segments
    correction = lambda b, segments=False: value_correction(StatePassPlan(b, 2048 if segments else None))
    out += [(build_chunk_forward, (hqk, hv, 128, 128, dtype, h0, ht, b, False, True, True, correction(b)))
            for (h0, ht), b in itertools.product(flags, widths)]
    if all_flags:  # context parallelism: its scans (the forward's; the reverse pass's by its own maps or by the
        # forward's transposed), its first two passes (states only; the second with zero values) and its last pass
        out += [(build_segment_scan, (hv, 128, 128, backwards, transposed))
                for backwards, transposed in ((False, False), (True, False), (True, True))]
        out += [(build_chunk_forward, (hqk, hv, 128, 128, dtype, False, True, b, False, False, True,
                                       correction(b, True))) for b in widths]
        out += [(build_chunk_forward, (hqk, hv, 128, 128, dtype, False, True, b, False, False, False,
                                       correction(b, True))) for b in widths]
        out += [(build_chunk_forward, (hqk, hv, 128, 128, dtype, True, False, b, False, True, True,
                                       correction(b, True))) for b in widths]
    if "backward" in kernels:
        out += [(build_chunk_local_gradients, (hqk, hv, 128, 128, dtype, l2norm, HOPPER_SMS))
                for l2norm in (True, False)]
        out.append((build_chunk_scores, (hqk, hv, 128, dtype)))  # P, for the narrow reverse passes
        for has_state, b in itertools.product([True, False], [b for b in widths if b <= WALK_WIDEST]):
            out.append((build_chunk_forward, (hqk, hv, 128, 128, dtype, has_state, False, b, True, False, True,
                                              correction(b))))
            scores = b in SCORES_WIDTHS
            out.append((build_reverse_state_pass, (hqk, hv, 128, 128, dtype, has_state, b, True, True, scores)))
            # context parallelism's first reverse pass (no stores) and its transition pass (no dO either)
            out.append((build_reverse_state_pass, (hqk, hv, 128, 128, dtype, False, b, False, not has_state,
                                                   scores)))
        if all_flags:  # in the segments of a forward that ran whole-head programs in segments: the
            # recompute, and the reverse pass's first and last passes at whole heads
            out.append((build_chunk_forward, (hqk, hv, 128, 128, dtype, True, False, 128, True, False, True,
                                              correction(128, True))))
            out.append((build_reverse_state_pass, (hqk, hv, 128, 128, dtype, False, 128, False, True)))
            out.append((build_reverse_state_pass, (hqk, hv, 128, 128, dtype, True, 128)))
            # the recompute at whole heads over whole sequences (the GPU tests' walks at every width)
            out.append((build_chunk_forward, (hqk, hv, 128, 128, dtype, True, False, 128, True, False, True,
                                              correction(128))))
    return out


def compile_one(task, record=False):
    """Compile one program; returns its report line and (``record``) the kernel-cache directories TileLang
    looked up, by wrapping its cache's private path lookup for this one compile."""
    from tilelang.cache.kernel_cache import KernelCache

    build, config = task
    looked_up = []
    cache_path = KernelCache._get_cache_path

    def recorded(self, key):
        looked_up.append(cache_path(self, key))
        return looked_up[-1]

    if record:
        KernelCache._get_cache_path = recorded
    try:
        start = time.perf_counter()
        compile_program(build, *config)
    finally:
        KernelCache._get_cache_path = cache_path
    return f"{build.__name__}{config}: {time.perf_counter() - start:.1f} s", looked_up


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", default=QWEN_HEADS, help="comma-separated HqkxHv")
    p.add_argument("--dtypes", default="bfloat16", help="comma-separated: bfloat16, float16")
    p.add_argument("--all-flags", action="store_true", help="every (initial state, final state) pair, not just both on")
    p.add_argument("--block-v", default="128,64,32", help="comma-separated value-block widths of the state pass")
    p.add_argument("--kernels", default="forward", help="comma-separated: forward, backward, decode")
    p.add_argument("--jobs", type=int, default=1, help="compiling processes")
    p.add_argument("--cache-list", type=Path, help="append the programs' cache directories to this file")
    args = p.parse_args()
    heads = [tuple(int(x) for x in h.split("x")) for h in args.heads.split(",")]
    widths = [int(b) for b in args.block_v.split(",")]
    tasks = list(dict.fromkeys(t for (hqk, hv), dtype in itertools.product(heads, args.dtypes.split(","))
                               for t in programs(hqk, hv, dtype, widths, args.all_flags, args.kernels.split(","))))
    print(f"cache: {os.environ.get('TILELANG_CACHE_DIR', '~/.tilelang/cache')}; {len(tasks)} programs", flush=True)
    start = time.perf_counter()
    cache_dirs = set()
    with ProcessPoolExecutor(args.jobs) as pool:
        for line, looked_up in pool.map(functools.partial(compile_one, record=args.cache_list is not None), tasks):
            print(line, flush=True)
            cache_dirs.update(looked_up)
    print(f"done in {time.perf_counter() - start:.0f} s")
    if args.cache_list:
        root = os.environ.get("TILELANG_CACHE_DIR", os.path.expanduser("~/.tilelang/cache"))
        with args.cache_list.open("a") as f:
            f.writelines(os.path.relpath(d, root) + "\n" for d in sorted(cache_dirs))


if __name__ == "__main__":
    main()
