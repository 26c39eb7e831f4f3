"""Random problems and error measures shared by the tests."""

import pytest
import torch
import torch.nn.functional as F

# The marks of a test that runs the Hopper kernels (``pytestmark = HOPPER``).
HOPPER = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                       reason="needs an sm_90 GPU"),
]
HOPPER_DIM = 128  # K = V of the kernels
# DESIGN.md section 5: the gradients' relative RMS bounds, by input name.
# In the order the backward returns the gradients.
GRAD_TOL = {"q": 8e-3, "k": 8e-3, "v": 8e-3, "g": 2e-2, "beta": 2e-2, "initial_state": 8e-3}
DIFFERENTIABLE = tuple(GRAD_TOL)


def rel_rms(x, ref):
    """``||x - ref|| / ||ref||`` in float64; NaN anywhere fails any threshold."""
    x, ref = x.double(), ref.double()
    err = (x - ref).norm() / ref.norm().clamp_min(1e-30)
    return float("inf") if torch.isnan(x).any() else err.item()


def make_inputs(batch=1, length=130, hqk=2, hv=4, kdim=32, vdim=32, dtype=torch.float64,
                device="cpu", decay="normal", key_scale=1.0, seqs=None, initial_state=False, seed=0):
    """Fresh inputs for one call; ``seqs`` (lengths) makes a packed varlen batch with B == 1."""
    gen = torch.Generator().manual_seed(seed)
    if seqs is not None:
        batch, length = 1, sum(seqs)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    q = rnd(batch, length, hqk, kdim)
    k = rnd(batch, length, hqk, kdim) * key_scale
    v = rnd(batch, length, hv, vdim)
    g = {"normal": F.logsigmoid(rnd(batch, length, hv)) / 4,
         "none": torch.zeros(batch, length, hv, dtype=torch.float64),
         "strong": -5 - 15 * torch.rand(batch, length, hv, generator=gen, dtype=torch.float64)}[decay]
    beta = torch.rand(batch, length, hv, generator=gen, dtype=torch.float64)
    out = dict(q=q, k=k, v=v, g=g, beta=beta)
    out = {n: x.to(dtype if n in "qkv" else torch.float32 if dtype != torch.float64 else dtype) for n, x in out.items()}
    n_state = batch
    if seqs is not None:
        out["cu_seqlens"] = torch.tensor([0] + list(torch.tensor(seqs).cumsum(0)), dtype=torch.int32)
        n_state = len(seqs)
    if initial_state:
        out["initial_state"] = rnd(n_state, hv, kdim, vdim).to(torch.float64 if dtype == torch.float64 else torch.float32)
    return {n: x.to(device) for n, x in out.items()}


def hopper_inputs(dtype=torch.bfloat16, **kw):
    """:func:`make_inputs` at K = V = 128 on the GPU: (2, 8) heads and keys with |k| near 1, not normalised,
    unless ``kw`` says otherwise."""
    kw = {"key_scale": HOPPER_DIM ** -0.5, "hqk": 2, "hv": 8, **kw}
    return make_inputs(kdim=HOPPER_DIM, vdim=HOPPER_DIM, dtype=dtype, device="cuda", **kw)
