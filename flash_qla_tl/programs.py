"""Every program the launchers can ask for at one head config: what a build ships and a cache warms.

``scripts/export_programs.py`` exports exactly :func:`head_config_programs` for
each shipped (head config, dtype), and ``kernels.shipped.covers_head_config``
trusts that: so this list must hold every config a launcher passes to
``compile_program`` (``tests/test_programs.py`` checks it against the planners).
"""

from __future__ import annotations

import itertools

from .hopper_backward import SCORES_WIDTHS, WALK_WIDEST
from .hopper_forward import BLOCK_WIDTHS, StatePassPlan, pass_makes_query_norms, pass_variant
from .kernels.causal_conv_prefill import build_causal_conv_prefill, build_causal_conv_prefill_backward
from .kernels.causal_conv_step import build_causal_conv_step
from .kernels.chunk_forward import build_chunk_forward
from .kernels.chunk_local_gradients import build_chunk_local_gradients
from .kernels.chunk_prep import build_chunk_prep, most_heads_per_program
from .kernels.chunk_scores import build_chunk_scores
from .kernels.gated_rms_norm import build_gated_rms_norm, build_gated_rms_norm_backward
from .kernels.inverse_norms import build_inverse_norms
from .kernels.recurrent_step import BLOCK_WIDTHS as DECODE_WIDTHS
from .kernels.recurrent_step import RecurrentStepConfig, build_recurrent_step
from .kernels.reverse_state_pass import build_reverse_state_pass
from .kernels.segment_scan import build_segment_scan
from .kernels.sequence_pieces import CHUNK_ROWS, SEGMENT_STARTS, build_sequence_pieces

KINDS = ("forward", "backward", "decode")
# The persistent local-gradient programs run one program per SM, a compile-time count: a build ships them
# for the sm_90 parts' SM counts, H100 SXM / H200 / H800 / GH200 (132), H100 PCIe / H800 PCIe (114), H20 (78).
SHIPPED_SMS = (132, 114, 78)
# Qwen3.5/3.6's GDN heads (Hqk, Hv) per model, and per rank under tensor parallelism up to 8 ways.
QWEN_MODEL_HEADS = ((16, 64), (16, 48), (16, 32), (16, 16))
QWEN_HEAD_CONFIGS = tuple(sorted({(hqk // tp, hv // tp) for hqk, hv in QWEN_MODEL_HEADS for tp in (1, 2, 4, 8)},
                                 reverse=True))


def parse_head_configs(text: str) -> list[tuple[int, int]]:
    """The scripts' ``--heads``: ``"16x32,2x8"`` -> ``[(16, 32), (2, 8)]``."""
    return [tuple(int(n) for n in heads.split("x")) for heads in text.split(",")]


def head_config_programs(hqk: int, hv: int, dtype: str, widths=BLOCK_WIDTHS, all_flags: bool = True,
                         kernels=KINDS, sms=SHIPPED_SMS) -> list[tuple]:
    """Every ``(factory, config)`` the launchers can ask for at one head config and dtype.

    ``kernels``: a subset of :data:`KINDS`; ``widths``: the state pass's value-block
    widths; ``all_flags``: every (initial state, final state) pair and context
    parallelism's programs, else both states on and no segments (a warm cache for
    the common call); ``sms``: the SM counts of the GPUs served (only the persistent
    backward programs depend on it).  ``tests/test_programs.py`` checks this list
    against the planners' choices.
    """
    flags = list(itertools.product([True, False], repeat=2)) if all_flags else [(True, True)]
    conv_channels = (2 * hqk + hv) * 128  # the layer's conv runs over q, k and v's channels
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
        # the layer's glue at inference (Qwen3.5's conv1d has no bias): the conv's step and the gated RMSNorm
        out += [(build_causal_conv_step, (conv_channels, 4, dtype, False, True)), (build_gated_rms_norm, (128, dtype))]
    if "forward" not in kernels and "backward" not in kernels:
        return out
    # the layer's conv over whole sequences (dense and packed) and its gated RMSNorm, and their backward; the
    # conv writes q, k and v as planes of their own (the layer without a cache) or the projection's layout (a
    # cached prefill, the function)
    conv_builds = [build_causal_conv_prefill] + ([build_causal_conv_prefill_backward] if "backward" in kernels else [])
    conv_planes = [(hqk * 128, hqk * 128, hv * 128), (conv_channels,)]
    out += [(build, (conv_channels, 4, dtype, False, True, packed, planes))
            for build, packed, planes in itertools.product(conv_builds, (False, True), conv_planes)]
    norm_builds = ([] if "decode" in kernels else [build_gated_rms_norm]) + (
        [build_gated_rms_norm_backward] if "backward" in kernels else [])  # the forward: listed with decode's
    out += [(build, (128, dtype)) for build in norm_builds]
    # chunk_prep: (store_inverse, store_keys) of the forward's plans and of the backward, each with and
    # without the keys' norms (the l2norm), with one value head a program and with the most (prep_heads)
    preps = [(False, False), (False, True)] + ([(True, True)] if "backward" in kernels else [])
    out += [(build_chunk_prep, (hqk, hv, 128, dtype, inverse, keys, l2norm, heads))
            for (inverse, keys), l2norm, heads in itertools.product(
                preps, (True, False), sorted({1, most_heads_per_program(hqk, hv)}))]
    out += [(build_inverse_norms, (hqk, 128, dtype)),
            (build_sequence_pieces, (CHUNK_ROWS,)), (build_sequence_pieces, (SEGMENT_STARTS,))]
    # a state pass's trailing arguments, per width, for one pass over whole sequences or over segments, with or
    # without the output (the output's pass at whole heads is the transposed chain), and an output's pass with
    # the queries' norms loaded (or ones) and, where an inference forward's l2norm asks, made in the pass
    variant = lambda b, segments=False, output=False, norms=False: pass_variant(  # noqa: E731
        StatePassPlan(b, 2048 if segments else None), output, norms)
    norms_of = lambda b: (False, True) if pass_makes_query_norms(b, hqk, hv) else (False,)  # noqa: E731
    out += [(build_chunk_forward, (hqk, hv, 128, 128, dtype, h0, ht, b, False, True, True,
                                   *variant(b, output=True, norms=norms)))
            for (h0, ht), b in itertools.product(flags, widths) for norms in norms_of(b)]
    if all_flags:  # context parallelism: its scans (the forward's; the reverse pass's by its own maps or by the
        # forward's transposed), its first two passes (states only; the second with zero values) and its last pass
        out += [(build_segment_scan, (hv, 128, 128, backwards, transposed))
                for backwards, transposed in ((False, False), (True, False), (True, True))]
        # (whole heads: both in one launch)
        narrow = [b for b in widths if b < 128]
        out += [(build_chunk_forward, (hqk, hv, 128, 128, dtype, False, True, b, False, False, True,
                                       *variant(b, True))) for b in narrow]
        out += [(build_chunk_forward, (hqk, hv, 128, 128, dtype, False, True, b, False, False, False,
                                       *variant(b, True))) for b in narrow]
        if 128 in widths:
            out.append((build_chunk_forward, (hqk, hv, 128, 128, dtype, False, True, 128, False, False, True,
                                              *pass_variant(StatePassPlan(128, 2048), False, joint=True))))
        out += [(build_chunk_forward, (hqk, hv, 128, 128, dtype, True, False, b, False, True, True,
                                       *variant(b, True, True, norms))) for b in widths for norms in norms_of(b)]
    if "backward" in kernels:
        out += [(build_chunk_local_gradients, (hqk, hv, 128, 128, dtype, l2norm, count))
                for l2norm, count in itertools.product((True, False), sms)]
        out.append((build_chunk_scores, (hqk, hv, 128, dtype)))  # P, for the narrow reverse passes
        # both walks at every width: the walks' own, and whole heads (hopper_backward.throughput_bound); the
        # narrow reverse passes also as context parallelism's first pass (no stores) and its transition pass
        # (no dO either)
        for has_state, b in itertools.product([True, False], widths):
            out.append((build_chunk_forward, (hqk, hv, 128, 128, dtype, has_state, False, b, True, False, True,
                                              *variant(b))))
            scores = b in SCORES_WIDTHS
            out.append((build_reverse_state_pass, (hqk, hv, 128, 128, dtype, has_state, b, True, True, scores)))
            if b <= WALK_WIDEST:
                out.append((build_reverse_state_pass, (hqk, hv, 128, 128, dtype, False, b, False, not has_state,
                                                       scores)))
        if all_flags:  # in the segments of a forward that ran whole-head programs in segments: the
            # recompute, and the reverse pass's first pass at whole heads
            out.append((build_chunk_forward, (hqk, hv, 128, 128, dtype, True, False, 128, True, False, True,
                                              *variant(128, True))))
            out.append((build_reverse_state_pass, (hqk, hv, 128, 128, dtype, False, 128, False, True)))
    return out
