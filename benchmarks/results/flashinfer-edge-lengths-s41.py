"""FlashInfer's outputs per sequence against float64 on edge lengths (which sequence's state is off)."""
import sys
import torch
sys.path.insert(0, "benchmarks")
from bench_forward import make_problem, peers, rel_rms  # noqa: E402
from flash_qla_tl import reference  # noqa: E402

libs = peers(names=("flashinfer",))
for seqs in ([1000, 24, 0, 1], [1000, 24, 1], [1000, 0, 24], [64, 1], [130, 0]):
    for mode in ("normalized", "l2norm"):
        x = make_problem(16, 32, seqs, mode)
        l2 = mode == "l2norm"
        ref = reference.chunked_gated_delta_rule(**{n: t.double() if t.is_floating_point() else t for n, t in x.items()},
                                                 output_final_state=True, use_qk_l2norm_in_kernel=l2)
        for lib, fn in libs.items():
            o, s = fn(**x, output_final_state=True, use_qk_l2norm_in_kernel=l2)
            cu = x["cu_seqlens"].tolist()
            errs = []
            for n in range(len(seqs)):
                a, b = cu[n], cu[n + 1]
                eo = rel_rms(o[:, a:b], ref[0][:, a:b]) if b > a else float("nan")
                errs.append(f"seq {n} (len {b - a}): o {eo:.1e} state {rel_rms(s[n], ref[1][n]):.1e}")
            print(f"{lib:14s} {seqs} {mode}: " + "; ".join(errs), flush=True)
