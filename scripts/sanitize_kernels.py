"""Every Hopper kernel once on a small varlen problem with edge lengths, for compute-sanitizer.

    compute-sanitizer --tool racecheck python scripts/sanitize_kernels.py [--forward-only | --chunked-only | --decode-only | --layer-only]

Lengths 1, 64, 0, 635, 300 (T = 1000, not a multiple of 64; an empty and a
one-token sequence), (2, 8) and (2, 6) heads, an initial state, in-kernel l2norm:
the forward under every state-pass plan (each value-block width, and context
parallelism with its segment scan, narrow and at whole heads: the joint first pass), and again on q and k normalised by the caller
(l2norm off: the variants of ``chunk_prep`` that read the keys' norms instead of
making them), and that forward captured in a CUDA graph and replayed with offsets that
end before the token axis does (the tables built on the device, the rows past the last
sequence zeroed by the output pass), then forward + backward through autograd
(the recompute, the scores and the reverse walk, the local gradient kernel), the
backward with its walks at each width of their own (32 columns: the scores kernel), with
the recompute at whole heads beside a 64-column reverse pass, and in segments of their
own, and the backward in the segments of forwards that kept them (narrow and
whole-head); then
the decoding kernel at each value-block width on lengths 1, 0, 16, 3, 0, 7,
its state once in a new tensor and once updated in place, and captured and replayed on
offsets that end 3 tokens early (the rows past the last sequence zeroed by its last programs); and the layer's
conv over packed sequences (lengths 1, 0, 70, 3, 300, 2: two programs' rows) with its backward, its
conv step and gated RMSNorm with its backward (``hopper_layer.py``).  The
outputs and the gradients are checked against the float64 reference, so a sanitizer run that
disturbs the kernels' timing also shows whether the results moved.
"""

import argparse
import functools
import itertools
import sys
from pathlib import Path

import torch

# The repository's package unless PYTHONPATH names another revision's first (device_run.sh's TEST_PACKAGE).
sys.path.append(str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import DIFFERENTIABLE, GRAD_TOL, make_inputs, rel_rms  # noqa: E402

import flash_qla_tl as fq  # noqa: E402
from flash_qla_tl import hopper_backward, hopper_forward, hopper_layer, hopper_recurrent, reference  # noqa: E402
from flash_qla_tl.kernels.recurrent_step import BLOCK_WIDTHS as DECODE_WIDTHS  # noqa: E402

SEQS = [1, 64, 0, 635, 300]
DECODE_SEQS = [1, 0, 16, 3, 0, 7]
TOL = 5e-3


def float64(inputs):
    """The float64 copy of a problem's inputs that the references run on (integer tensors kept)."""
    return {n: t.double() if t.is_floating_point() else t for n, t in inputs.items()}


def check_decode(hqk, hv):
    x = make_inputs(seqs=DECODE_SEQS, hqk=hqk, hv=hv, kdim=128, vdim=128, dtype=torch.bfloat16, device="cuda",
                    initial_state=True)
    ref = float64(x)
    o_ref, s_ref = reference.recurrent_gated_delta_rule(**ref, output_final_state=True, use_qk_l2norm_in_kernel=True)
    for block_v in DECODE_WIDTHS:
        for in_place in (False, True):
            state = x["initial_state"].clone()
            o, s = hopper_recurrent.recurrent_forward(**dict(x, initial_state=state), scale=None,
                                                      output_final_state=True, use_qk_l2norm_in_kernel=True,
                                                      final_state=state if in_place else None, block_v=block_v)
            errors = rel_rms(o, o_ref), rel_rms(s, s_ref)
            print(f"({hqk},{hv}) decode block_v {block_v}{' in place' if in_place else ''}: "
                  f"relative RMS o {errors[0]:.2e}, state {errors[1]:.2e}", flush=True)
            assert max(errors) <= TOL, errors
    check_captured(x, {
        f"({hqk},{hv}) decode block_v {block_v}": lambda inputs, block_v=block_v: hopper_recurrent.recurrent_forward(
            **inputs, scale=None, output_final_state=True, use_qk_l2norm_in_kernel=True, block_v=block_v)
        for block_v in DECODE_WIDTHS},
        functools.partial(reference.recurrent_gated_delta_rule, use_qk_l2norm_in_kernel=True), padding=3)


def check_conv_prefill():
    """The layer's conv over packed sequences (an empty and one-token ones; 384 channels, with a bias, written
    in three planes whose edges fall inside a warp's channels), forward and backward, against float64
    autograd."""
    lengths = [1, 0, 70, 3, 300, 2]
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], device="cuda")
    x = torch.randn(1, sum(lengths), 384, device="cuda").bfloat16().transpose(1, 2).requires_grad_()
    weight, bias = (torch.randn(*s, device="cuda").bfloat16().requires_grad_() for s in ((384, 4), (384,)))
    dy = torch.randn(1, 384, sum(lengths), device="cuda").bfloat16()
    planes = (64, 64, 256)
    planar = hopper_layer.CausalConvPrefill.apply(x, weight, bias, "silu", cu_seqlens, planes)
    y = torch.cat(hopper_layer.plane_views(planar, 1, sum(lengths), planes), dim=-1).transpose(1, 2)
    got = (y, *torch.autograd.grad(y, (x, weight, bias), dy))
    leaves = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
    want = torch.nn.functional.silu(reference.causal_conv1d(*leaves, cu_seqlens))
    want = (want, *torch.autograd.grad(want, leaves, dy.double()))
    errors = [rel_rms(a, b) for a, b in zip(got, want)]
    print("conv prefill: relative RMS y, dx, dweight, dbias " + ", ".join(f"{e:.2e}" for e in errors))
    assert max(errors) <= TOL, errors


def check_layer_glue():
    """The layer's conv step (1000 channels: a partial last program) and gated RMSNorm (33 rows: a partial
    program), forward and backward."""
    x = torch.randn(3, 1, 1000, device="cuda").bfloat16().transpose(1, 2)
    state, weight, bias = (torch.randn(3, 1000, 4, device="cuda").bfloat16(),
                           torch.randn(1000, 4, device="cuda").bfloat16(), torch.randn(1000, device="cuda").bfloat16())
    window = torch.cat([state, x], -1).double()[..., 1:]
    want = torch.nn.functional.silu((window * weight.double()).sum(-1, keepdim=True) + bias.double()[:, None])
    y = hopper_layer.causal_conv1d_step(x, state, weight, bias, "silu")
    print(f"conv step: relative RMS {rel_rms(y, want):.2e}, state moved {torch.equal(state.double(), window)}")
    assert rel_rms(y, want) <= TOL and torch.equal(state.double(), window)
    rows, gates = (torch.randn(33, 128, device="cuda").bfloat16() for _ in range(2))
    norm_weight = torch.randn(128, device="cuda").bfloat16()
    want = reference.gated_rms_norm(rows.double(), gates.double(), norm_weight.double(), 1e-6)
    y = hopper_layer.gated_rms_norm(rows, gates, norm_weight, 1e-6)
    print(f"gated RMSNorm: relative RMS {rel_rms(y, want):.2e}")
    assert rel_rms(y, want) <= TOL
    leaves = [t.double().requires_grad_() for t in (rows, gates, norm_weight)]
    dy = torch.randn(33, 128, device="cuda").bfloat16()
    want = torch.autograd.grad(reference.gated_rms_norm(*leaves, 1e-6), leaves, dy.double())
    got = hopper_layer.gated_rms_norm_backward(rows, gates, norm_weight, 1e-6, dy)
    errors = [rel_rms(g, w) for g, w in zip(got, want)]
    print("gated RMSNorm backward: relative RMS dx, dz, dweight " + ", ".join(f"{e:.2e}" for e in errors))
    assert max(errors) <= 2 * TOL, errors  # the module's roundings of ds and dn: twice the forward's


def check_captured(x, runs, reference_fn, padding):
    """Each of ``runs`` (name: a call on inputs like ``x``) captured in a CUDA graph, then replayed with offsets
    that end ``padding`` tokens before the token axis does (a graph runtime's padding): nothing is checked on
    the host then, and the kernels must write zeros to the rows past the last sequence (the forward's output
    pass and the decoding step, each in its last sequence's programs; the forward's tables come from the device,
    ``sequence_pieces``).  Checked against ``reference_fn`` in float64 on the inputs cut at the new end."""
    cu = x["cu_seqlens"].clone()
    x = dict(x, cu_seqlens=cu)
    end = int(cu[-1]) - padding
    cut = {n: t[:, :end] if n in ("q", "k", "v", "g", "beta") else t for n, t in x.items()}
    cut["cu_seqlens"] = torch.cat([cu[:-1], cu.new_tensor([end])])
    want = reference_fn(**float64(cut), output_final_state=True)
    for name, run in runs.items():
        run(x)  # compiles outside the capture
        cu.copy_(x["cu_seqlens"])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o, s = run(x)
        cu.copy_(cut["cu_seqlens"])
        o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        errors = rel_rms(o[:, :end], want[0]), rel_rms(s, want[1])
        print(f"{name} replayed, offsets ending {padding} tokens early: relative RMS o {errors[0]:.2e}, "
              f"state {errors[1]:.2e}", flush=True)
        assert max(errors) <= TOL and not o[:, end:].any(), errors


def backward_with_walks(plan, *args, recompute=None):
    """``hopper_backward.chunk_backward(*args)`` with the walks' own plan ``plan`` (the recompute's
    ``recompute``, default the same)."""
    own, own_recompute = hopper_backward.plan_walks, hopper_backward.plan_recompute
    hopper_backward.plan_walks = lambda *_: plan
    hopper_backward.plan_recompute = lambda *_: recompute or plan
    try:
        return hopper_backward.chunk_backward(*args)
    finally:
        hopper_backward.plan_walks, hopper_backward.plan_recompute = own, own_recompute


def main():
    print(f"flash_qla_tl from {Path(fq.__file__).parent}", flush=True)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--forward-only", action="store_true", help="the forward kernels only")
    p.add_argument("--chunked-only", action="store_true", help="the forward and backward kernels only")
    p.add_argument("--decode-only", action="store_true", help="the decoding kernels only")
    p.add_argument("--layer-only", action="store_true", help="the layer's glue kernels only")
    args = p.parse_args()
    decode = not (args.forward_only or args.chunked_only)
    if decode:
        check_conv_prefill()
        check_layer_glue()
    if args.layer_only:
        return
    for hqk, hv in ((2, 8), (2, 6)):
        if decode:
            check_decode(hqk, hv)
        if args.decode_only:
            continue
        x = make_inputs(seqs=SEQS, hqk=hqk, hv=hv, kdim=128, vdim=128, dtype=torch.bfloat16, device="cuda",
                        initial_state=True)
        ref = float64(x)
        o_ref, s_ref = reference.chunked_gated_delta_rule(**ref, output_final_state=True, use_qk_l2norm_in_kernel=True)
        plans = [hopper_forward.StatePassPlan(b, None) for b in hopper_forward.BLOCK_WIDTHS]
        # context parallelism in segments of 4 chunks: narrow, and whole heads (the joint first pass)
        plans += [hopper_forward.StatePassPlan(32, 256), hopper_forward.StatePassPlan(128, 256)]
        normalized = dict(x, q=torch.nn.functional.normalize(x["q"], dim=-1),
                          k=torch.nn.functional.normalize(x["k"], dim=-1))
        for l2norm, inputs, want in ((True, x, (o_ref, s_ref)), (False, normalized, None)):
            if want is None:
                want = reference.chunked_gated_delta_rule(
                    **float64(inputs),
                    output_final_state=True)
            for plan in plans:
                o, s = hopper_forward.chunk_forward(**inputs, scale=None, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=l2norm, plan=plan)
                errors = rel_rms(o, want[0]), rel_rms(s, want[1])
                print(f"({hqk},{hv}) forward {plan}{'' if l2norm else ', q/k normalised'}: relative RMS o "
                      f"{errors[0]:.2e}, state {errors[1]:.2e}", flush=True)
                assert max(errors) <= TOL, errors
        check_captured(normalized, {
            f"forward {plan}": lambda inputs, plan=plan: hopper_forward.chunk_forward(
                **inputs, scale=None, output_final_state=True, plan=plan)
            for plan in (hopper_forward.StatePassPlan(128, None), hopper_forward.StatePassPlan(32, 256))},
            reference.chunked_gated_delta_rule, padding=50)
        if args.forward_only:
            continue
        names = DIFFERENTIABLE
        do, dht = torch.randn_like(o_ref).float(), torch.randn_like(s_ref).float()
        ref_leaves = {n: t.detach().requires_grad_() if t.is_floating_point() else t for n, t in ref.items()}
        o_ref, s_ref = reference.chunked_gated_delta_rule(**ref_leaves, output_final_state=True,
                                                          use_qk_l2norm_in_kernel=True)
        ref_grads = torch.autograd.grad((o_ref, s_ref), [ref_leaves[n] for n in names], (do.double(), dht.double()))
        leaves = {n: t.detach().clone().requires_grad_() if t.is_floating_point() else t for n, t in x.items()}
        o, s = fq.chunk_gated_delta_rule(**leaves, output_final_state=True, use_qk_l2norm_in_kernel=True)
        runs = {"backward": torch.autograd.grad((o, s), [leaves[n] for n in names], (do.to(o.dtype), dht))}
        inputs = (*(x[n] for n in ("q", "k", "v", "g", "beta")), None, x["initial_state"], do.to(o.dtype), dht, True,
                  x["cu_seqlens"])
        for block_v in hopper_forward.BLOCK_WIDTHS:  # the walks' own plan at each width, unsplit (whole heads
            # where they overflow half the SMs: plan_walks)
            plan = hopper_forward.StatePassPlan(block_v, None)
            runs[f"backward, walks at {block_v} columns"] = backward_with_walks(plan, *inputs)
        # the recompute at whole heads beside a narrower reverse pass, as plan_recompute gives on a full GPU
        runs["backward, reverse at 64 columns, recompute at whole heads"] = backward_with_walks(
            hopper_forward.StatePassPlan(64, None), *inputs, recompute=hopper_forward.StatePassPlan(128, None))
        # the walks split into segments of their own (four chunks): the reverse scan by the reverse maps
        plan = hopper_forward.StatePassPlan(32, 256)
        runs["backward, walks in segments of their own"] = backward_with_walks(plan, *inputs)
        # the walks in the segments a forward kept (the recompute from its entry states, the reverse
        # scan with its transitions), after narrow and whole-head forwards; in one-chunk segments
        # (16 x Hv of them) the reverse pass takes whole heads on 132 SMs (plan_walks_in_segments)
        for plan in (hopper_forward.StatePassPlan(32, 256), hopper_forward.StatePassPlan(128, 256),
                     hopper_forward.StatePassPlan(128, 64)):
            reverse = hopper_backward.plan_walks_in_segments(sum(SEQS), hv, plan, x["v"].device)[1]
            *_, kept = hopper_forward.chunk_forward(**x, scale=None, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True, plan=plan, return_kept=True)
            runs[f"backward in the forward's segments {plan}, reverse {reverse}"] = hopper_backward.chunk_backward(
                *(x[n] for n in ("q", "k", "v", "g", "beta")), None, x["initial_state"], do.to(o.dtype), dht,
                True, x["cu_seqlens"], kept.segments)
        for name, grads in runs.items():
            errors = {n: rel_rms(g, r) for n, g, r in zip(names, grads, ref_grads)}
            print(f"({hqk},{hv}) {name}: relative RMS " + ", ".join(f"d{n} {e:.2e}" for n, e in errors.items()),
                  flush=True)
            assert all(errors[n] <= GRAD_TOL[n] for n in names), errors
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
