"""One eager backward, then ``torch.autograd.grad`` captured in a CUDA graph, in a fresh process.

What a graph runtime does with a training step (warm-up calls on a side stream,
then capture, as ``torch.cuda.graphs`` prescribes), on one long sequence, so that
the walks run over segments and build their tables on the device.  A fresh
process, so that nothing an earlier test loaded or cached helps the capture.
Exits non-zero if the capture fails or a replay differs from the eager gradients;
``tests/test_hopper_backward.py`` runs it.

    python tests/first_capture.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import flash_qla_tl as fq  # noqa: E402
from flash_qla_tl import hopper_forward  # noqa: E402
from helpers import DIFFERENTIABLE, hopper_inputs  # noqa: E402


def main():
    print("flash_qla_tl from", Path(fq.__file__).parent)
    x = hopper_inputs(hv=4, seqs=[8190], initial_state=True)
    total, num_seqs, hv = x["v"].shape[1], x["cu_seqlens"].numel() - 1, x["v"].shape[2]
    # The forward splits the long sequence into segments and the walks take them: both device-built
    # layouts run under capture.
    assert hopper_forward.plan_state_pass(total, num_seqs, hv, x["v"].device).segment_tokens is not None
    leaves = [x[n].detach().clone().requires_grad_() for n in DIFFERENTIABLE]
    # Autograd runs the backward on the forward's stream; the legacy default stream cannot join a capture.
    forward_stream = torch.cuda.Stream()
    forward_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(forward_stream):
        o, ht = fq.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], cu_seqlens=x["cu_seqlens"],
                                          output_final_state=True)
    torch.cuda.current_stream().wait_stream(forward_stream)
    gen = torch.Generator("cuda").manual_seed(1)
    out_grads = [torch.randn(o.shape, device="cuda", generator=gen).to(o.dtype),
                 torch.randn(ht.shape, device="cuda", generator=gen) * 0.1]
    step = lambda: torch.autograd.grad([o, ht], leaves, out_grads, retain_graph=True)
    eager = step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for t in captured:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    same = [torch.equal(c, e) for c, e in zip(captured, eager)]
    print("replay equals the eager gradients:", dict(zip(DIFFERENTIABLE, same)))
    sys.exit(0 if all(same) else 1)


if __name__ == "__main__":
    main()
