"""How far one call's graph-replayed time moves between fresh captures of it.

    python benchmarks/capture_spread.py --heads 8x16 --lengths 1x8192 --mode normalized --captures 6
    python benchmarks/capture_spread.py --heads 8x16 --lengths 1x8192 --backward --no-peers

Single cells of the A/B and grid tables have read 1.3-1.5x the other
measurements of the same code on their row (BENCHMARKS.md "Measurement: same
code in both columns" and "Session 20"), so far always in a column of this
library.  This times one call ``--captures`` times per library, each with
``timing.graph_ms`` as the benchmarks do (a capture of its own, the warm-up, the
replays), the libraries interleaved capture by capture, and prints every
capture's time.  One slow capture among fast ones points at the graph (how it
was instantiated, the memory it was given); a slow stretch that every library
shares points at the machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_backward import backward_step, output_grads  # noqa: E402
from bench_forward import (  # noqa: E402
    BACKWARD_PEERS, FORWARD_PEERS, MODES, make_problem, parse_heads, parse_lengths, peer_names, peers)
from timing import graph_ms  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", default="8x16", help="HqkxHv")
    p.add_argument("--lengths", default="1x8192", help="LENxCOUNT or A+B+...")
    p.add_argument("--mode", default="normalized", choices=MODES)
    p.add_argument("--captures", type=int, default=6, help="fresh captures per library")
    p.add_argument("--backward", action="store_true",
                   help="time the backward alone (bench_backward.py's call) instead of the forward")
    p.add_argument("--no-peers", action="store_true", help="this library only")
    p.add_argument("--peers", help="comma-separated peers to time (default: every one that imports)")
    args = p.parse_args()
    (hqk, hv), = parse_heads(args.heads, [])
    seqs = parse_lengths(args.lengths)
    x = make_problem(hqk, hv, seqs, args.mode)
    l2norm = args.mode == "l2norm"
    calls = {}
    for lib, fn in peers(names=peer_names(args, BACKWARD_PEERS if args.backward else FORWARD_PEERS)).items():
        if args.backward:
            calls[lib] = backward_step(fn, x, output_grads(sum(seqs), len(seqs), hv), l2norm)
        else:
            calls[lib] = lambda fn=fn: fn(**x, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    times = {lib: [] for lib in calls}
    print(f"{'backward' if args.backward else 'forward'} ({hqk},{hv}) {args.lengths} {args.mode}, "
          f"{torch.cuda.get_device_name()}: ms per call, one column per fresh capture", flush=True)
    for _ in range(args.captures):
        for lib, call in calls.items():
            times[lib].append(graph_ms(call))
    for lib, ms in times.items():
        spread = max(ms) / min(ms)
        print(f"{lib:>16}: " + " ".join(f"{t:.3f}" for t in ms)
              + f"  | median {statistics.median(ms):.3f}, max / min {spread:.2f}", flush=True)


if __name__ == "__main__":
    main()
