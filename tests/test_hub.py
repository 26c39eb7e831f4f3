"""The Hugging Face kernel-hub package: build.toml, the built variant, its ops, layers and Transformers integration.

CPU tests load the package the way users do (`get_kernel` offline through
LOCAL_KERNELS) and compare kernelized tiny Qwen3.5 / Qwen3.5-MoE models with
the unpatched ones.  GPU tests (sm_90) repeat that on CUDA in bf16.
"""

import copy
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import huggingface_hub
import kernels.layer.repos
import pytest
import torch
from kernels import Mode, get_kernel, kernelize, use_kernel_mapping
from kernels._rust import Backend, Build, Metadata
from kernels.layer.layer import _validate_layer
from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

import flash_qla_tl
from helpers import make_inputs, rel_rms

ROOT = Path(__file__).resolve().parent.parent
TRANSFORMERS_MODELING = (modeling_qwen3_5, modeling_qwen3_5_moe)
GDN_CLASSES = (modeling_qwen3_5.Qwen3_5GatedDeltaNet, modeling_qwen3_5_moe.Qwen3_5MoeGatedDeltaNet)
CUDA_TORCH = torch.version.cuda is not None


def build_hub(out: Path) -> Path:
    """Run `scripts/build_hub.py --out DIR`, which writes DIR/build/torch-cuda."""
    subprocess.run([sys.executable, ROOT / "scripts" / "build_hub.py", "--out", out], check=True)
    return out


@pytest.fixture(scope="session")
def hub_build(tmp_path_factory) -> Path:
    return build_hub(tmp_path_factory.mktemp("hub"))


def local_kernels_path(hub_build: Path) -> Path:
    # A CPU-only torch rejects the torch-cuda variant when resolving a repository,
    # so on CPU LOCAL_KERNELS names the variant directory itself (kernels accepts both).
    return hub_build if CUDA_TORCH else hub_build / "build" / "torch-cuda"


@pytest.fixture(scope="session")
def flash_qla(hub_build):
    """The built package, loaded with `get_kernel` offline: LOCAL_KERNELS and HF_HUB_OFFLINE."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LOCAL_KERNELS", f"qwen/flash-qla={local_kernels_path(hub_build)}")
        env.setenv("HF_HUB_OFFLINE", "1")
        env.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        return get_kernel("qwen/flash-qla", version=1)


@pytest.fixture(autouse=True)
def restore_transformers_function_hooks():
    """kernelize rebinds `forward` on Transformers' module-level hooked functions; undo it after each test."""
    yield
    for module in TRANSFORMERS_MODELING:
        for hooked in vars(module).values():
            if isinstance(hooked, torch.nn.Module) and hasattr(type(hooked), "kernel_layer_name"):
                vars(hooked).pop("forward", None)


def tiny_model(moe=False, head_dim=16, device="cpu", dtype=torch.float32, seed=0):
    """Random-weight Qwen3.5 (or Qwen3.5-MoE) with 3 GatedDeltaNet layers, grouped value heads (2 -> 4)."""
    common = dict(
        vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, linear_key_head_dim=head_dim, linear_value_head_dim=head_dim, linear_num_key_heads=2,
        linear_num_value_heads=4, pad_token_id=0,
    )
    if moe:
        config = Qwen3_5MoeTextConfig(**common, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                      num_experts=4, num_experts_per_tok=2)
    else:
        config = Qwen3_5TextConfig(**common, intermediate_size=128)
    torch.manual_seed(seed)
    model_class = Qwen3_5MoeForCausalLM if moe else Qwen3_5ForCausalLM
    return model_class(config).to(device=device, dtype=dtype).eval()


def gdn_layers(model):
    return [m for m in model.modules() if isinstance(m, GDN_CLASSES)]


def prefill_and_decode(model, input_ids, steps=3):
    """Logits of a cached prefill and of `steps` cached single-token steps (teacher-forced: no argmax ties)."""
    with torch.no_grad():
        out = model(input_ids[:, :-steps], use_cache=True)
        logits = [out.logits]
        for t in range(input_ids.shape[1] - steps, input_ids.shape[1]):
            out = model(input_ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
            logits.append(out.logits)
    return torch.cat(logits, dim=1)


def random_ids(batch=2, length=70, device="cpu", seed=1):
    return torch.randint(1, 128, (batch, length), generator=torch.Generator().manual_seed(seed)).to(device)


# ---- packaging ------------------------------------------------------------------------------------


def test_build_toml_is_edition_5_torch_noarch_for_sm90():
    build = Build.open(ROOT)  # kernels' own parser: raises on any field it does not know
    assert build.general.backends == [Backend.CUDA]
    config = tomllib.loads((ROOT / "build.toml").read_text())
    assert (config["general"]["name"], config["general"]["edition"]) == ("flash-qla", 5)
    assert config["torch-noarch"] == {"cuda_capabilities": ["9.0a"]}


def test_build_writes_a_noarch_variant_with_the_library_vendored(hub_build, tmp_path, capsys):
    from kernels.cli.info import print_kernel_info  # the CLI needs sigstore, absent on the GPU image
    variant = build_hub(tmp_path) / "build" / "torch-cuda"  # a fresh build: nothing has imported it yet
    metadata = Metadata.read_from_file(variant / "metadata.json")
    assert str(metadata.name) == "flash-qla" and metadata.version == 1
    assert metadata.backend.backend_type == Backend.CUDA and metadata.backend.archs == ["9.0a"]
    unique_id = re.fullmatch(r"_flash_qla_cuda_([0-9a-f]{10})", metadata.id).group(1)
    assert f'_OPS_NAME = f"_flash_qla_{{get_backend()}}_{unique_id}"' in (variant / "_ops.py").read_text()
    session_build = Metadata.read_from_file(hub_build / "build" / "torch-cuda" / "metadata.json")
    assert session_build.id == metadata.id  # the namespace is a hash of the sources

    for name in ("__init__.py", "ops.py", "layers.py", "flash_qla_tl/__init__.py", "flash_qla_tl/api.py"):
        assert (variant / name).is_file(), name
    assert not list(variant.rglob("__pycache__"))
    library = ROOT / "flash_qla_tl" / "api.py"
    assert (variant / "flash_qla_tl" / "api.py").read_text() == library.read_text()

    print_kernel_info(str(tmp_path))
    assert {"Name: flash-qla", "Backends: cuda"} <= set(capsys.readouterr().out.splitlines())


def test_source_tree_for_nix_has_the_library_vendored(tmp_path):
    subprocess.run([sys.executable, ROOT / "scripts" / "build_hub.py", "--source-tree", tmp_path], check=True)
    assert Build.open(tmp_path).general.backends == [Backend.CUDA]
    assert "genKernelFlakeOutputs" in (tmp_path / "flake.nix").read_text()
    package = tmp_path / "torch-ext" / "flash_qla"
    assert (package / "layers.py").is_file() and (package / "flash_qla_tl" / "api.py").is_file()
    assert not (package / "_ops.py").exists()  # kernel-builder generates it


def test_kernels_prefers_the_compiled_variant_where_it_can_run():
    """`build_hub.py --compiled` names its variants for kernels' resolver: the compiled one wherever its
    runtime needs hold (x86-64 Linux, tvm-ffi 0.1, a CUDA 13 torch), the pure-Python one everywhere else."""
    from kernels.backends import CPU, CUDA
    from kernels.variants import _resolve_variant_for_system, parse_variant
    from packaging.version import Version

    sys.path.insert(0, str(ROOT / "scripts"))
    import build_hub

    compiled = build_hub.compiled_variant_name()
    assert re.fullmatch(r"tvm-ffi01-cu1\d\d-x86_64-linux", compiled), compiled
    variants = [parse_variant(compiled), parse_variant("torch-universal")]

    def chosen(backend, tvm_ffi="0.1", cpu="x86_64"):
        for order in (variants, variants[::-1]):  # the Hub lists them in no particular order
            accepted, _ = _resolve_variant_for_system(order, backend, cpu, "linux", Version("2.11"), True,
                                                      tvm_ffi and Version(tvm_ffi))
            yield accepted[0].variant_str

    cuda = parse_variant(compiled).arch.backend  # a system with the toolkit's CUDA version
    assert set(chosen(cuda)) == {compiled}
    assert set(chosen(cuda, tvm_ffi=None)) == {"torch-universal"}  # apache-tvm-ffi not installed
    assert set(chosen(cuda, cpu="aarch64")) == {"torch-universal"}
    assert set(chosen(CUDA(version=Version("12.8")))) == {"torch-universal"}
    assert set(chosen(CPU())) == {"torch-universal"}


def test_get_kernel_loads_offline_in_a_fresh_process_without_tilelang(hub_build, tmp_path):
    """get_kernel imports neither TileLang nor Transformers; eager calls, forward and backward, do not go through
    the custom ops, whose first call imports torch._dynamo (seconds of a fresh process's first forward)."""
    script = (
        "import sys, torch\n"
        "from kernels import get_kernel\n"
        "flash_qla = get_kernel('qwen/flash-qla', version=1)\n"
        "print(flash_qla.__file__)\n"
        "print(sorted(m for m in ('tilelang', 'transformers', 'flash_qla_tl') if m in sys.modules))\n"
        "q, k = (torch.randn(1, 9, 1, 16, requires_grad=True) for _ in range(2))\n"
        "v = torch.randn(1, 9, 2, 16, requires_grad=True)\n"
        "g, beta = -torch.rand(1, 9, 2), torch.rand(1, 9, 2)\n"
        "o, state = flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)\n"
        "o.sum().backward()\n"
        "flash_qla.fused_recurrent_gated_delta_rule(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1],\n"
        "                                           initial_state=state, output_final_state=True)\n"
        "print(sorted(m for m in ('tilelang', 'torch._dynamo') if m in sys.modules))\n"
    )
    env = {
        "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
        "LOCAL_KERNELS": f"qwen/flash-qla={local_kernels_path(hub_build)}",
    }
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    module_file, imported, imported_by_calls = result.stdout.splitlines()
    assert Path(module_file) == hub_build / "build" / "torch-cuda" / "__init__.py"
    assert imported == "[]"  # TileLang is lazy; the library is the vendored copy
    assert imported_by_calls == "[]"


# ---- operators ------------------------------------------------------------------------------------


@pytest.mark.parametrize("through_ops", [False, True], ids=["eager", "ops"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("op_name", ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"])
def test_ops_match_the_library_in_values_and_gradients(flash_qla, op_name, packed, through_ops, monkeypatch):
    """The public functions, eagerly (the library's autograd) and through the custom ops (what a traced call
    takes), against the library."""
    ops = sys.modules[f"{flash_qla.__name__}.ops"]
    plain, through = [], []
    plain_eager, call = ops.plain_eager, ops._call
    monkeypatch.setattr(ops, "plain_eager", lambda *t: plain.append(plain_eager(*t)) or not through_ops)
    monkeypatch.setattr(ops, "_call", lambda *args: through.append(args[0]) or call(*args))
    inputs = make_inputs(batch=2, length=70, hqk=2, hv=4, kdim=16, vdim=8, dtype=torch.float32,
                         seqs=[30, 1, 39] if packed else None, initial_state=True)
    copies = [{n: x.clone().requires_grad_(x.is_floating_point()) for n, x in inputs.items()} for _ in range(2)]
    results = []
    for operator, args in ((getattr(flash_qla, op_name), copies[0]), (getattr(flash_qla_tl, op_name), copies[1])):
        o, final_state = operator(**args, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seq_lens_q=None)
        (o.square().sum() + final_state.square().sum()).backward()
        results.append([o, final_state] + [args[n].grad for n in ("q", "k", "v", "g", "beta", "initial_state")])
    assert plain == [True]  # plain tensors, no tracing
    assert through == ([getattr(ops, "_chunk_op" if op_name.startswith("chunk") else "_recurrent_op")]
                       if through_ops else [])
    for ours, library in zip(*results):
        assert rel_rms(ours, library) < 1e-5


def test_traced_calls_take_the_ops(flash_qla):
    """make_fx (non-strict tracing: a dispatch mode, no compiling flag) records the custom ops, not the
    library's PyTorch that a plain eager call runs."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x = make_inputs(length=9, hqk=1, hv=2, kdim=16, vdim=16, dtype=torch.float32, initial_state=True)
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "initial_state")]
    for name in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"):
        fn = getattr(flash_qla, name)
        graph = make_fx(lambda *a, fn=fn: fn(*a[:5], initial_state=a[5], output_final_state=True))(*args).graph
        called = [str(n.target) for n in graph.nodes if n.op == "call_function"]
        assert any(c.endswith(f".{name}.default") for c in called), called


def test_ops_pass_opcheck(flash_qla):
    ops = sys.modules[f"{flash_qla.__name__}.ops"]
    x = make_inputs(length=20, hqk=2, hv=4, kdim=16, vdim=8, dtype=torch.float32, seqs=[7, 13], initial_state=True)
    grad = lambda t: t.clone().requires_grad_()
    for op in (ops._chunk_op, ops._recurrent_op):
        qkvgb = [grad(x[n]) for n in ("q", "k", "v", "g", "beta")]
        torch.library.opcheck(op, (*qkvgb, None, grad(x["initial_state"]), True, True, x["cu_seqlens"], True))
        torch.library.opcheck(op, (*qkvgb, 0.3, None, False, False, None, False))
    qkvgb = [x[n] for n in ("q", "k", "v", "g", "beta")]
    inplace = ops._recurrent_inplace_op
    torch.library.opcheck(inplace, (*qkvgb, None, x["initial_state"].clone(), True, x["cu_seqlens"], None, None, False))
    torch.library.opcheck(inplace, (*qkvgb, 0.3, x["initial_state"][:1].clone(), False, None, torch.randn(4),
                                    torch.randn(4), True))


def test_ops_compile_without_graph_breaks(flash_qla):
    def prefill_then_decode(q, k, v, g, beta, initial_state):
        o, state = flash_qla.chunk_gated_delta_rule(q[:, :-1], k[:, :-1], v[:, :-1], g[:, :-1], beta[:, :-1],
                                                    initial_state=initial_state, output_final_state=True)
        step, state = flash_qla.fused_recurrent_gated_delta_rule(q[:, -1:], k[:, -1:], v[:, -1:], g[:, -1:],
                                                                 beta[:, -1:], initial_state=state,
                                                                 output_final_state=True)
        return o.square().sum() + step.square().sum() + state.square().sum()

    x = make_inputs(length=40, hqk=2, hv=4, kdim=16, vdim=8, dtype=torch.float32, initial_state=True)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    compiled_args = [x[n].clone().requires_grad_() for n in names]
    eager_args = [x[n].clone().requires_grad_() for n in names]
    torch.compile(prefill_then_decode, fullgraph=True, backend="aot_eager")(*compiled_args).backward()
    prefill_then_decode(*eager_args).backward()
    for compiled, eager in zip(compiled_args, eager_args):
        assert rel_rms(compiled.grad, eager.grad) < 1e-6


# ---- layers and kernelize -----------------------------------------------------------------------


def test_layers_pass_kernels_validation(flash_qla):
    # The hooked functions are instances of classes that kernels generates from their signatures.
    chunk_hook, recurrent_hook = (type(getattr(modeling_qwen3_5, name)) for name in (
        "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"))
    checks = [(cls, flash_qla.layers.Qwen3_5GatedDeltaNet) for cls in GDN_CLASSES] + [
        (chunk_hook, flash_qla.layers.ChunkGatedDeltaRule),
        (recurrent_hook, flash_qla.layers.FusedRecurrentGatedDeltaRule),
    ]
    for transformers_class, layer in checks:
        _validate_layer(check_cls=transformers_class, cls=layer, repo=layer.__name__)  # raises on mismatch
        assert layer.has_backward and layer.can_torch_compile
    hooks = {transformers_class.kernel_layer_name for transformers_class, _ in checks}
    assert hooks == set(flash_qla.kernel_mapping()) == {
        "Qwen3_5GatedDeltaNet", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"}


@pytest.mark.parametrize("capability", [80, 90, 100])
def test_cuda_mapping_selects_sm90_only(flash_qla, monkeypatch, capability):
    monkeypatch.setattr(kernels.layer.repos, "_find_capability", lambda: capability)  # the device's, as 10 * major + minor
    model = tiny_model()  # kernelize only rebinds forward, so a CPU model can stand in for a CUDA one
    with use_kernel_mapping(flash_qla.kernel_mapping("cuda", flash_qla.mapping.PACKAGE_DIR)):
        kernelize(model, mode=Mode.INFERENCE, device="cuda")
    ours = flash_qla.layers.Qwen3_5GatedDeltaNet.forward
    assert [layer.forward.__func__ is ours for layer in gdn_layers(model)] == [capability == 90] * 3


def check_kernelize_matches(flash_qla, model, input_ids, tolerance, monkeypatch):
    """kernelize_qwen3_5 swaps every GDN layer; prefill and cached decoding match the unpatched model."""
    reference = prefill_and_decode(model, input_ids)
    flash_qla.kernelize_qwen3_5(model)
    assert len(gdn_layers(model)) == 3
    assert all(layer.forward.__func__ is flash_qla.layers.Qwen3_5GatedDeltaNet.forward for layer in gdn_layers(model))

    decode_calls = []
    recurrent = flash_qla.layers.fused_recurrent_gated_delta_rule
    monkeypatch.setattr(flash_qla.layers, "fused_recurrent_gated_delta_rule",
                        lambda *a, **kw: decode_calls.append(1) or recurrent(*a, **kw))
    assert rel_rms(prefill_and_decode(model, input_ids), reference) < tolerance
    assert len(decode_calls) == 3 * 3  # 3 GDN layers x 3 cached single-token steps


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_kernelize_swaps_every_gdn_layer_and_matches_the_model(flash_qla, moe, monkeypatch):
    check_kernelize_matches(flash_qla, tiny_model(moe=moe), random_ids(), 1e-5, monkeypatch)


def check_greedy_generate_matches(flash_qla, model, input_ids):
    """Greedy decoding of the kernelized model gives the unpatched model's tokens."""
    generate = lambda m: m.generate(input_ids, max_new_tokens=12, do_sample=False, min_new_tokens=12,
                                    pad_token_id=0)
    want = generate(model)
    got = generate(flash_qla.kernelize_qwen3_5(model))
    assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_greedy_generate_gives_the_model_tokens(flash_qla, moe):
    check_greedy_generate_matches(flash_qla, tiny_model(moe=moe), random_ids(length=20))


def test_function_hooks_match_transformers_operators(flash_qla):
    model, input_ids = tiny_model(), random_ids()
    reference = prefill_and_decode(model, input_ids)
    only_functions = {hook: repos for hook, repos in flash_qla.kernel_mapping("cpu", flash_qla.mapping.PACKAGE_DIR)
                      .items() if hook != "Qwen3_5GatedDeltaNet"}
    with use_kernel_mapping(only_functions):
        kernelize(model, mode=Mode.INFERENCE, device="cpu")
    assert modeling_qwen3_5.torch_chunk_gated_delta_rule.forward.__func__ is flash_qla.layers.ChunkGatedDeltaRule.forward
    recurrent_hook = modeling_qwen3_5.torch_recurrent_gated_delta_rule
    assert recurrent_hook.forward.__func__ is flash_qla.layers.FusedRecurrentGatedDeltaRule.forward
    assert rel_rms(prefill_and_decode(model, input_ids), reference) < 1e-5


def test_register_kernel_mapping_lets_kernels_kernelize(flash_qla):
    model = tiny_model()
    with use_kernel_mapping({}):  # a scratch copy of the global mapping, dropped on exit
        flash_qla.register_kernel_mapping("cpu")
        kernelize(model, mode=Mode.INFERENCE, device="cpu")
    assert all(layer.forward.__func__ is flash_qla.layers.Qwen3_5GatedDeltaNet.forward for layer in gdn_layers(model))


def test_module_layer_keeps_packed_sequences_apart(flash_qla):
    layer = gdn_layers(flash_qla.kernelize_qwen3_5(tiny_model()))[0]
    first, second = torch.randn(1, 9, 64), torch.randn(1, 23, 64)
    cu_seq_lens_q = torch.tensor([0, 9, 32], dtype=torch.int32)
    with torch.no_grad():
        packed = layer(torch.cat([first, second], dim=1), cu_seq_lens_q=cu_seq_lens_q, use_cache=False)
        separate = torch.cat([layer(first), layer(second)], dim=1)
    assert rel_rms(packed, separate) < 1e-5


def test_module_layer_compiles_without_graph_breaks(flash_qla):
    layer = gdn_layers(flash_qla.kernelize_qwen3_5(tiny_model().train()))[0]
    hidden_states = torch.randn(2, 20, 64, requires_grad=True)
    torch.compile(layer, fullgraph=True, backend="aot_eager")(hidden_states).square().sum().backward()
    compiled_grads = [hidden_states.grad.clone(), layer.A_log.grad.clone()]
    hidden_states.grad, layer.A_log.grad = None, None
    layer(hidden_states).square().sum().backward()
    assert rel_rms(compiled_grads[0], hidden_states.grad) < 1e-5
    assert rel_rms(compiled_grads[1], layer.A_log.grad) < 1e-5


def check_gradients_match(ours: dict, reference: dict, flat_tolerance, parameter_tolerance):
    """Named gradients against the unpatched model's: all of them together by relative RMS, and each one."""
    assert reference.keys() == ours.keys()
    flat = lambda grads: torch.cat([g.flatten() for g in grads.values()])
    assert rel_rms(flat(ours), flat(reference)) < flat_tolerance
    # A parameter whose gradient is a sliver of the whole (dt_bias: ~1e-9 in bf16) is judged
    # against 1% of the whole gradient's norm, not against its own rounding noise.
    floor = 1e-2 * flat(reference).double().norm()
    for name in reference:
        error = (ours[name].double() - reference[name].double()).norm() / torch.maximum(
            reference[name].double().norm(), floor)
        assert error < parameter_tolerance, (name, error.item())


def check_training_step_matches(flash_qla, model, input_ids, flat_tolerance, parameter_tolerance):
    """One loss.backward() of the kernelized model gives the unpatched model's parameter gradients."""
    def gradients(model):
        model(input_ids, labels=input_ids).loss.backward()
        return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    patched = flash_qla.kernelize_qwen3_5(copy.deepcopy(model))
    ours = gradients(patched)
    assert any("linear_attn.A_log" in name for name in ours)
    check_gradients_match(ours, gradients(model), flat_tolerance, parameter_tolerance)


def layer_values_and_gradients(layer, pieces, dy, **kwargs) -> dict:
    """The layer's output on the hidden states ``pieces`` (one call each, outputs concatenated along T) and
    the gradients, for output gradient ``dy``, of its input and of each of its parameters (summed over calls)."""
    layer.zero_grad(set_to_none=True)
    inputs = [x.detach().clone().requires_grad_() for x in pieces]
    y = torch.cat([layer(x, **kwargs) for x in inputs], dim=1)
    y.backward(dy)
    return {"output": y.detach(), "input": torch.cat([x.grad for x in inputs], dim=1),
            **{name: p.grad for name, p in layer.named_parameters()}}


def check_layer_matches(flash_qla, model, inputs, output_tolerance, flat_tolerance, parameter_tolerance):
    """The kernelized layer against Transformers' own (the same weights): output, and the gradients of its
    input and of every parameter (projections, conv, A_log, dt_bias, norm), on a dense batch, a batch with
    left padding (attention_mask), or packed sequences (cu_seq_lens_q; Transformers' layer runs each
    sequence on its own: its PyTorch path has no packed form)."""
    theirs = gdn_layers(model)[0]
    ours = gdn_layers(flash_qla.kernelize_qwen3_5(copy.deepcopy(model)))[0]
    device, dtype = theirs.A_log.device, theirs.in_proj_qkv.weight.dtype
    gen = torch.Generator().manual_seed(3)
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)
    if inputs == "packed":
        lengths = [9, 1, 23]
        pieces = [rnd(1, n, 64) for n in lengths]
        offsets = torch.tensor([0, 9, 10, 33], dtype=torch.int32, device=device)
        want = layer_values_and_gradients(theirs, pieces, dy := rnd(1, 33, 64))
        got = layer_values_and_gradients(ours, [torch.cat(pieces, dim=1)], dy, cu_seq_lens_q=offsets)
    else:
        hidden_states, dy, mask = rnd(2, 70, 64), rnd(2, 70, 64), {}
        if inputs == "padded":
            mask = {"attention_mask": torch.ones(2, 70, dtype=torch.long, device=device)}
            mask["attention_mask"][1, :12] = 0  # the second row's first 12 tokens are padding
        want = layer_values_and_gradients(theirs, [hidden_states], dy, **mask)
        got = layer_values_and_gradients(ours, [hidden_states], dy, **mask)
    assert rel_rms(got.pop("output"), want.pop("output")) < output_tolerance
    assert {"A_log", "dt_bias", "conv1d.weight", "norm.weight", "in_proj_qkv.weight"} < got.keys()
    check_gradients_match(got, want, flat_tolerance, parameter_tolerance)


@pytest.mark.parametrize("inputs", ["dense", "padded", "packed"])
def test_module_layer_matches_transformers_layer_in_values_and_gradients(flash_qla, inputs):
    check_layer_matches(flash_qla, tiny_model().train(), inputs, 1e-5, 1e-5, 1e-2)


def test_module_layer_matches_transformers_layer_with_a_cache(flash_qla):
    """Cached calls of the layer (a prefill, two single-token steps, then a 6-token continuation that reads
    the cached conv window and state) give Transformers' outputs and leave the same conv and recurrent
    states in the cache."""
    from transformers import DynamicCache

    model = tiny_model()
    theirs = gdn_layers(model)[0]
    ours = gdn_layers(flash_qla.kernelize_qwen3_5(copy.deepcopy(model)))[0]
    gen = torch.Generator().manual_seed(5)
    pieces = [torch.randn(2, n, 64, generator=gen) for n in (13, 1, 1, 6)]

    def run(layer):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            outputs = torch.cat([layer(x, cache_params=cache) for x in pieces], dim=1)
        idx = layer.layer_idx
        return outputs, cache.get_conv_state(idx).clone(), cache.get_recurrent_state(idx).clone()

    for got, want in zip(run(ours), run(theirs), strict=True):
        assert got.shape == want.shape
        assert rel_rms(got, want) < 1e-5


def test_training_step_gradients_match_the_model(flash_qla):
    # fp32 and two algorithms: the tiny gradients of strongly decayed heads differ the most (about 1e-3).
    check_training_step_matches(flash_qla, tiny_model().train(), random_ids(), 1e-5, 1e-2)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_trainer_loss_follows_the_unkernelized_model(flash_qla, tmp_path, monkeypatch, moe):
    """Trainer steps on the kernelized model (dense and MoE) give the unpatched model's losses: same
    weights, data and seed, fp32."""
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
    from transformers import Trainer, TrainingArguments

    def train(model):
        dataset = [{"input_ids": ids, "labels": ids} for ids in random_ids(batch=8, length=32)]
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4,
                                 learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none",
                                 use_cpu=True, disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=dataset)
        trainer.train()
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    model = tiny_model(moe=moe).train()
    reference = train(copy.deepcopy(model))
    patched = flash_qla.kernelize_qwen3_5(model)
    before = patched.model.layers[0].linear_attn.in_proj_qkv.weight.detach().clone()
    chunk_calls = []
    chunk = flash_qla.layers.chunk_gated_delta_rule
    monkeypatch.setattr(flash_qla.layers, "chunk_gated_delta_rule",
                        lambda *a, **kw: chunk_calls.append(1) or chunk(*a, **kw))
    losses = train(patched)
    assert len(losses) == 3 and len(chunk_calls) == 3 * 3  # 3 GDN layers x 3 steps
    assert rel_rms(torch.tensor(losses), torch.tensor(reference)) < 1e-4, (losses, reference)
    assert reference[-1] != reference[0]  # the steps trained: the comparison spans updated weights
    assert not torch.equal(patched.model.layers[0].linear_attn.in_proj_qkv.weight, before)


# ---- GPU (sm_90): the TileLang kernels ------------------------------------------------------------

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
sm90 = pytest.mark.skipif(not SM90, reason="flash-qla's TileLang kernels are built for sm_90a")


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_gpu_greedy_generate_gives_the_model_tokens(flash_qla, moe):
    model = tiny_model(moe=moe, head_dim=128, device="cuda", dtype=torch.bfloat16)
    check_greedy_generate_matches(flash_qla, model, random_ids(length=20, device="cuda"))


@pytest.mark.gpu
@sm90
def test_gpu_get_kernel_resolves_the_cuda_variant(flash_qla, hub_build):
    # LOCAL_KERNELS names the repository here: variant resolution and the 9.0a arch check both ran.
    assert Path(flash_qla.__file__) == hub_build / "build" / "torch-cuda" / "__init__.py"


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_gpu_kernelize_matches_the_model_in_bf16(flash_qla, moe, monkeypatch):
    model = tiny_model(moe=moe, head_dim=128, device="cuda", dtype=torch.bfloat16)
    check_kernelize_matches(flash_qla, model, random_ids(device="cuda"), 2e-2, monkeypatch)


@pytest.mark.gpu
@sm90
def test_gpu_training_step_gradients_match_the_model_in_bf16(flash_qla):
    model = tiny_model(head_dim=128, device="cuda", dtype=torch.bfloat16).train()
    check_training_step_matches(flash_qla, model, random_ids(device="cuda"), 3e-2, 1e-1)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("inputs", ["dense", "padded", "packed"])
def test_gpu_module_layer_matches_transformers_layer_in_bf16(flash_qla, inputs):
    # head dim 128: the conv, operator and norm kernels run; Transformers' layer runs PyTorch in bf16
    model = tiny_model(head_dim=128, device="cuda", dtype=torch.bfloat16).train()
    check_layer_matches(flash_qla, model, inputs, 2e-2, 3e-2, 1e-1)


@pytest.mark.gpu
@sm90
def test_gpu_chunk_op_hands_its_forwards_segments_to_the_backward(flash_qla, monkeypatch):
    """A forward run in segments (one long sequence, few heads) carries its entry states and transitions,
    and chunk_prep's outputs, to the backward: in the library's autograd (a plain eager call), and as
    outputs of the op, eagerly and compiled (so the fake gives their shapes).  The gradients are the
    library's, the backward's walks took the segments, and the backward ran no prep of its own."""
    ops = sys.modules[f"{flash_qla.__name__}.ops"]
    vendored = sys.modules[f"{flash_qla.__name__}.flash_qla_tl.hopper_backward"]
    vendored_forward = sys.modules[f"{flash_qla.__name__}.flash_qla_tl.hopper_forward"]
    handed, prepared = [], []
    walks, prepare = vendored.kernel_walks, vendored_forward.prepare_chunks
    monkeypatch.setattr(vendored, "kernel_walks", lambda *args: handed.append(args[-1]) or walks(*args))
    monkeypatch.setattr(vendored_forward, "prepare_chunks",
                        lambda *a, **kw: prepared.append(kw.get("prepared") is not None) or prepare(*a, **kw))
    x = make_inputs(seqs=[16384], hqk=1, hv=4, kdim=128, vdim=128, dtype=torch.bfloat16, device="cuda",
                    initial_state=True)
    names = ("q", "k", "v", "g", "beta", "initial_state")

    def loss(fn, args):
        o, state = fn(*args[:5], initial_state=args[5], cu_seqlens=x["cu_seqlens"], output_final_state=True,
                      use_qk_l2norm_in_kernel=True)
        return o.float().square().sum() + state.square().sum()

    def through_ops(*args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(ops, "plain_eager", lambda *t: False)
            return flash_qla.chunk_gated_delta_rule(*args, **kwargs)

    grads = []
    for fn in (flash_qla.chunk_gated_delta_rule, through_ops,
               torch.compile(flash_qla.chunk_gated_delta_rule, fullgraph=True, backend="aot_eager"),
               flash_qla_tl.chunk_gated_delta_rule):
        args = [x[n].clone().requires_grad_() for n in names]
        loss(fn, args).backward()
        grads.append([a.grad for a in args])
    assert len(handed) == 3 and all(h is not None and h.plan.segment_tokens for h in handed), handed
    assert prepared == [False, True] * 3  # each forward's prep, then its backward handed the outputs
    for op_grads in grads[:3]:
        assert all(rel_rms(a, b) < 1e-6 for a, b in zip(op_grads, grads[3])), [rel_rms(a, b) for a, b in
                                                                                 zip(op_grads, grads[3])]
