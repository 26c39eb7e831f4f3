"""A packed decode step (B sequences of one token, cu_seqlens) under CUDA graphs: main before (zero_tail_rows
launched after the step under capture) against the tree (the step's last programs zero those rows)."""
import sys
from pathlib import Path

import torch

root = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(root / "benchmarks"))
sys.path.insert(0, str(root))
from bench_forward import load_candidate  # noqa: E402
from timing import graph_ms, versions  # noqa: E402

import flash_qla_tl  # noqa: E402

pre = load_candidate(root / ".ab/pre/flash_qla_tl", "pre")
libs = {"before": pre.fused_recurrent_gated_delta_rule, "now": flash_qla_tl.fused_recurrent_gated_delta_rule}
print(torch.cuda.get_device_name(), versions())
for hqk, hv in ((16, 32), (2, 8)):
    for batch in (1, 8, 32, 128):
        q, k = (torch.randn(1, batch, hqk, 128, device="cuda").bfloat16() for _ in range(2))
        v = torch.randn(1, batch, hv, 128, device="cuda").bfloat16()
        g = torch.nn.functional.logsigmoid(torch.randn(1, batch, hv, device="cuda")) / 16
        beta = torch.sigmoid(torch.randn(1, batch, hv, device="cuda")).bfloat16()
        h0 = torch.randn(batch, hv, 128, 128, device="cuda")
        cu = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
        outs, times = {}, {}
        for name, fn in list(libs.items()) * 2:
            call = lambda fn=fn: fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                    use_qk_l2norm_in_kernel=True)
            outs[name] = call()
            times.setdefault(name, []).append(graph_ms(call, calls=20) * 1000)
        same = all(torch.equal(a, b) for a, b in zip(outs["before"], outs["now"]))
        print(f"({hqk},{hv}) B={batch}: before {min(times['before']):.2f} us, now {min(times['now']):.2f} us "
              f"(each the faster of two graphs), outputs bitwise equal: {same}", flush=True)
