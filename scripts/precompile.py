"""Fill TileLang's disk cache (``TILELANG_CACHE_DIR``) with the kernels, no GPU needed.

    python scripts/precompile.py                          # the Qwen3.5/3.6 head configs, bf16, state in and out
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
from flash_qla_tl.kernels.compile import compile_program  # noqa: E402
from flash_qla_tl.programs import QWEN_HEAD_CONFIGS, SHIPPED_SMS, head_config_programs, parse_head_configs  # noqa: E402


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
    p.add_argument("--heads", default=",".join(f"{hqk}x{hv}" for hqk, hv in QWEN_HEAD_CONFIGS),
                   help="comma-separated HqkxHv")
    p.add_argument("--dtypes", default="bfloat16", help="comma-separated: bfloat16, float16")
    p.add_argument("--all-flags", action="store_true", help="every (initial state, final state) pair, not just both on")
    p.add_argument("--block-v", default="128,64,32", help="comma-separated value-block widths of the state pass")
    p.add_argument("--kernels", default="forward", help="comma-separated: forward, backward, decode")
    p.add_argument("--sms", default=str(SHIPPED_SMS[0]),
                   help="comma-separated SM counts of the persistent backward programs (the GPU's: H100 SXM, H200)")
    p.add_argument("--jobs", type=int, default=1, help="compiling processes")
    p.add_argument("--cache-list", type=Path, help="append the programs' cache directories to this file")
    args = p.parse_args()
    heads = parse_head_configs(args.heads)
    widths = [int(b) for b in args.block_v.split(",")]
    tasks = list(dict.fromkeys(t for (hqk, hv), dtype in itertools.product(heads, args.dtypes.split(","))
                               for t in head_config_programs(hqk, hv, dtype, widths, args.all_flags,
                                                             args.kernels.split(","),
                                                             [int(n) for n in args.sms.split(",")])))
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
