"""Shipped programs: exported here, then loaded and launched without TileLang (CPU; a stand-in CUDA driver).

``scripts/export_programs.py`` turns compiled TileLang programs into libraries that need
only apache-tvm-ffi and the CUDA driver.  Here two programs are exported (one
with TMA descriptors and dynamic shared memory), and a fresh process that cannot import
TileLang loads them through ``compile_program`` and calls them on tensors that say they
live on a CUDA device.  ``tests/stub_libcuda.c`` stands in for libcuda.so.1 and logs
each driver call, so the test sees exactly what would reach the GPU: the cubin loaded,
the kernel, its grid, block and shared memory, its parameters and the TMA descriptors.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("tilelang")
pytest.importorskip("tvm_ffi")

ROOT = Path(__file__).resolve().parents[1]
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
sys.path.insert(0, str(ROOT / "scripts"))

import export_programs  # noqa: E402

from flash_qla_tl.kernels.compile import pass_configs_of  # noqa: E402
from flash_qla_tl.kernels.chunk_forward import build_chunk_forward  # noqa: E402
from flash_qla_tl.kernels.inverse_norms import build_inverse_norms  # noqa: E402
from flash_qla_tl.kernels.shipped import INDEX_NAME  # noqa: E402
from flash_qla_tl.programs import SHIPPED_SMS  # noqa: E402

# one head, two value heads, both states, 32-column programs
FORWARD = (1, 2, 128, 128, "bfloat16", True, True, 32, False, True, True, "in_chain")
PROGRAMS = [(build_inverse_norms, (2, 128, "bfloat16")), (build_chunk_forward, FORWARD)]

# Runs in a process where TileLang cannot be imported; prints the driver's log after each call.
CALLS = f"FORWARD = {FORWARD!r}\n" + textwrap.dedent('''
    import ctypes, json, sys
    sys.modules["tilelang"] = None  # as on a machine without it
    import torch, tvm_ffi
    from flash_qla_tl.kernels import compile as c
    from flash_qla_tl.kernels.chunk_forward import build_chunk_forward
    from flash_qla_tl.kernels.inverse_norms import build_inverse_norms

    driver = ctypes.CDLL("libcuda.so.1")
    driver.stub_log.restype = ctypes.c_char_p
    capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    capsule_pointer.restype, capsule_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]

    def on_cuda(t):
        """t's memory, described to the program as CUDA device 0's (DLPack's device type 2)."""
        capsule = torch.utils.dlpack.to_dlpack(t)
        ctypes.c_int32.from_address(capsule_pointer(capsule, b"dltensor") + 8).value = 2
        return tvm_ffi.from_dlpack(capsule)

    def call(name, program, params, *tensors):
        driver.stub_clear()
        driver.stub_expect_params(params)
        try:
            program(*(on_cuda(t) if isinstance(t, torch.Tensor) else t for t in tensors))
            outcome = "ok"
        except Exception as e:
            outcome = f"{type(e).__name__}: {e}"
        print(json.dumps({"call": name, "outcome": outcome, "log": driver.stub_log().decode(),
                          "pointers": [hex(t.data_ptr()) for t in tensors if isinstance(t, torch.Tensor)]}))

    assert not c.tilelang_importable()
    norms = c.compile_program(build_inverse_norms, 2, 128, "bfloat16")
    rows, out = torch.ones(130, 2, 128, dtype=torch.bfloat16), torch.empty(130, 4)
    call("inverse_norms", norms, 3, rows, out)
    call("inverse_norms again", norms, 3, rows, out)
    call("wrong dtype", norms, 3, torch.ones(130, 2, 128), out)
    forward = c.compile_program(build_chunk_forward, *FORWARD)
    t, bf16 = 100, torch.bfloat16  # one sequence of 100 tokens: two chunks
    q, k, v = torch.ones(t, 1, 128, dtype=bf16), torch.ones(t, 1, 128, dtype=bf16), torch.ones(t, 2, 128, dtype=bf16)
    norms, gamma = torch.ones(t, 4), torch.zeros(t, 4)
    a_keys, a_values = torch.zeros(1, 2, 64, dtype=bf16), torch.zeros(t, 2, 64, dtype=bf16)
    cu_seqlens, state = torch.tensor([0, t], dtype=torch.int32), torch.zeros(1, 2, 128, 128)
    out, chunk_states = torch.empty(t, 2, 128, dtype=bf16), torch.zeros(1, 2, 128, 128, dtype=bf16)
    call("chunk_forward", forward, 14, q, k, norms, norms.clone(), v, gamma, a_keys, a_values, cu_seqlens, state,
         0.5, out, state.clone(), chunk_states)
    try:
        c.compile_program(build_inverse_norms, 4, 128, "bfloat16")
        print(json.dumps({"call": "not shipped", "outcome": "ok"}))
    except c.KernelsUnavailable as e:
        print(json.dumps({"call": "not shipped", "outcome": f"KernelsUnavailable: {e}"}))
    print(json.dumps({"call": "tilelang imported", "outcome": str(sys.modules.get("tilelang") is not None)}))
''')


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """A directory with the exported programs and their index, and one with the stand-in driver."""
    out = tmp_path_factory.mktemp("shipped")
    programs = dict(export_programs.export_program(build, config, out) for build, config in PROGRAMS)
    (out / INDEX_NAME).write_text(json.dumps({"head_configs": [], "programs": programs}))
    driver = tmp_path_factory.mktemp("driver")
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", driver / "libcuda.so.1", ROOT / "tests" / "stub_libcuda.c"],
                   check=True)
    return out, driver


@pytest.fixture(scope="module")
def calls(shipped):
    out, driver = shipped
    env = {**os.environ, "FLASH_QLA_SHIPPED_DIR": str(out), "LD_LIBRARY_PATH": str(driver),
           "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", CALLS], env=env, capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    return {c["call"]: c for c in map(json.loads, run.stdout.splitlines())}


def params(log_line: str) -> list[int]:
    return [int(p, 16) for p in log_line.split("params=")[1].split(",")]


def test_libraries_need_only_tvm_ffi_and_the_driver(shipped):
    out, _ = shipped
    for library in out.glob("*.so"):
        undefined = subprocess.run(["nm", "-D", "--undefined-only", library], capture_output=True, text=True,
                                   check=True).stdout.split()
        symbols = [u for u in undefined if u not in ("U", "w")]
        names = {u.split("@")[0] for u in symbols if not u.startswith("_")}
        assert names <= {"TVMFFIEnvGetStream", "TVMFFIErrorSetRaisedFromCStr", "TVMFFIFunctionCall",
                         "TVMFFIFunctionCreate", "dlopen", "dlsym", "pthread_mutex_lock", "pthread_mutex_unlock",
                         "pthread_once", "snprintf", "strcmp"}, names
        # glibc's x86-64 baseline versions only, so that the library loads on older systems too
        versions = {u.split("@")[1] for u in symbols if "@" in u}
        assert versions <= {"GLIBC_2.2.5", "GLIBC_2.3"}, versions


def test_launch_without_tilelang(calls):
    first = calls["inverse_norms"]
    assert first["outcome"] == "ok"
    log = first["log"].splitlines()
    assert log[0] == "cuInit 0" and "cuDevicePrimaryCtxRetain 0" in log and "cuModuleLoadData elf=1" in log
    assert "cuModuleGetFunction inverse_norms_kernel" in log
    launch = [line for line in log if line.startswith("cuLaunchKernel")]
    assert len(launch) == 1
    # 130 rows in blocks of 64 rows x 2 heads, 128 threads, no dynamic shared memory, the default stream (no
    # torch stream given)
    assert "grid=3,2,1 block=128,1,1 shared=0 stream=(nil)" in launch[0]
    rows, out = (int(p, 16) for p in first["pointers"])
    assert params(launch[0]) == [out & 0xFFFFFFFF, rows & 0xFFFFFFFF, 130]  # the CUDA kernel's order: r, x, T
    # the module and function are loaded once per device
    again = calls["inverse_norms again"]["log"]
    assert "cuModuleLoadData" not in again and "cuModuleGetFunction" not in again and again.count("cuLaunch") == 1


def test_host_checks_still_raise(calls):
    wrong = calls["wrong dtype"]
    assert wrong["outcome"].startswith("RuntimeError") and "dtype mismatch, expected bfloat16" in wrong["outcome"]
    assert "cuLaunchKernel" not in wrong["log"]


def test_tma_descriptors_and_dynamic_shared_memory(calls):
    forward = calls["chunk_forward"]
    assert forward["outcome"] == "ok", forward["outcome"]
    log = forward["log"].splitlines()
    maps = [line for line in log if line.startswith("cuTensorMapEncodeTiled")]
    v = int(forward["pointers"][4], 16)
    # v [100 tokens, 2 heads, 128] bf16 (type 9), innermost first; the driver gets the outer strides in bytes
    assert any(f"address={hex(v)} dims=128,100,2 strides=512,256 box=32,64,1" in m for m in maps), maps
    launch = next(line for line in log if line.startswith("cuLaunchKernel"))
    # 128 / 32 value blocks x 2 value heads x 1 sequence; four warpgroups; above the default 48 KB of shared memory
    assert "grid=4,2,1 block=512,1,1" in launch
    shared = int(launch.split("shared=")[1].split()[0])
    assert shared > 48 * 1024 and f"cuFuncSetAttribute 8 {shared}" in log
    # each descriptor reaches the kernel by value: the stand-in marks the ones it encoded with 0xd5 and the rank
    # (the whole word: a pointer's low half may start with 0xd5 too, as heap addresses 0x55..d5...... do)
    markers = {0xD5000000 | int(m.split("rank=")[1].split()[0]) for m in maps}
    assert sum(p in markers for p in params(launch)) == len(maps)


def test_missing_program_and_no_tilelang(calls):
    assert calls["not shipped"]["outcome"].startswith("KernelsUnavailable")
    assert calls["tilelang imported"]["outcome"] == "False"


def test_which_configs_run_without_tilelang(monkeypatch, tmp_path):
    """Without TileLang a Hopper call takes the kernels only where the build ships its head config, dtype and SM
    count; elsewhere the PyTorch path, with one warning that says why."""
    from flash_qla_tl import context_parallel, hopper_forward
    from flash_qla_tl.kernels import compile as compile_module
    from flash_qla_tl.kernels import shipped

    (tmp_path / INDEX_NAME).write_text(json.dumps({"head_configs": [[2, 8, "bfloat16"]], "sms": [132, 114],
                                                   "programs": {}}))
    monkeypatch.setenv("FLASH_QLA_SHIPPED_DIR", str(tmp_path))
    monkeypatch.setattr(compile_module, "tilelang_importable", lambda: False)
    monkeypatch.setattr(hopper_forward, "device_unsupported_reason", lambda x: None)  # as on an H100 / H200
    sms = 132
    monkeypatch.setattr(context_parallel, "num_sms", lambda device: sms)
    compile_module.warn_unavailable.cache_clear()
    q = torch.empty(1, 64, 2, 128, dtype=torch.bfloat16)
    v8, v4 = torch.empty(1, 64, 8, 128, dtype=torch.bfloat16), torch.empty(1, 64, 4, 128, dtype=torch.bfloat16)
    assert shipped.covers_head_config(2, 8, "bfloat16", 132)
    assert hopper_forward.unsupported_reason(q, q, v8) is None
    with pytest.warns(RuntimeWarning, match=r"\(Hqk, Hv\) = \(2, 4\) in bfloat16.*PyTorch path"):
        reason = hopper_forward.unsupported_reason(q, q, v4)
    assert "TileLang is not installed" in reason
    with pytest.warns(RuntimeWarning, match="in float16"):  # fp16 is not shipped
        assert hopper_forward.unsupported_reason(q.half(), q.half(), v8.half()) is not None
    sms = 114  # an H100 PCIe, also shipped
    assert hopper_forward.unsupported_reason(q, q, v8) is None
    sms = 66  # a GPU whose persistent backward programs this build does not ship
    with pytest.warns(RuntimeWarning, match="on a GPU of 66 SMs"):
        assert hopper_forward.unsupported_reason(q, q, v8) is not None


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
def test_gpu_compiled_package_runs_without_tilelang_or_nvcc(tmp_path):
    """The issue-17 path end to end on a Hopper GPU: the compiled variant for one small head config built here,
    then a fresh process without TileLang, nvcc or a TileLang cache loads it with get_kernel and runs a forward
    and a backward whose outputs and gradients equal the TileLang build's bit for bit."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import cold_start

    subprocess.run([sys.executable, ROOT / "scripts" / "build_hub.py", "--compiled", "--heads", "1x2", "--dtypes",
                    "bfloat16", "--jobs", str(os.cpu_count()), "--out", tmp_path], check=True)
    result = cold_start.shipped_first_calls(tmp_path, 1, 2)
    assert "tvm-ffi01-cu1" in result["kernel_file"] and not result["tilelang_imported"]
    assert not result["dynamo_imported"]  # eager calls do not go through the custom ops
    assert result["identical_to_tilelang_build"], result


def sections(image: bytes) -> dict[str, bytes]:
    """A cubin's sections by name: their file contents (none for NOBITS)."""
    headers, names = export_programs.section_headers(image)
    return {name: b"" if h[1] == 8 else image[h[4]:h[4] + h[5]] for h, name in zip(headers, names)}


def test_debug_sections_are_cut_and_nothing_else_changes(tmp_path):
    """The shipped cubins lose nvcc's line tables and PTX text (TileLang always asks for them) and keep every
    other section byte for byte."""
    from flash_qla_tl.kernels.compile import compile_with_tilelang

    kernel = compile_with_tilelang(build_chunk_forward, FORWARD, pass_configs_of(build_chunk_forward))
    kernel.export_library(str(tmp_path / "tilelang.so"))
    cubin, _ = export_programs.cuda_module(export_programs.elf_symbol(tmp_path / "tilelang.so",
                                                                      export_programs.LIBRARY_BIN))
    stripped = export_programs.strip_debug_sections(cubin)
    before, after = sections(cubin), sections(stripped)
    assert before.keys() == after.keys()
    debug = {n for n in before if n.startswith((".debug_", ".nv_debug_", ".rela.debug_", ".rela.nv_debug_"))}
    assert {".nv_debug_ptx_txt", ".debug_line"} <= debug and ".text.chunk_forward_kernel" not in debug
    assert all(after[n] == b"" for n in debug)
    assert all(after[n] == before[n] for n in before.keys() - debug)
    assert len(stripped) < len(cubin) / 2


def test_compiled_build_is_a_kernel_variant_that_get_kernel_loads(tmp_path, monkeypatch, capsys):
    """`build_hub.py --compiled` (here with one small program standing in for a head config's list): the arch
    variant and torch-universal beside it, metadata kernels reads (tvm-ffi among the Python dependencies),
    `kernels info`, and `get_kernel` loading the variant in a fresh process that cannot import TileLang."""
    import tomllib

    import build_hub
    from kernels._rust import Backend, Metadata
    from kernels.cli.info import print_kernel_info

    monkeypatch.setattr(export_programs, "head_config_programs", lambda hqk, hv, dtype: [PROGRAMS[0]])
    config = tomllib.loads((ROOT / "build.toml").read_text())
    variant, universal = build_hub.build_compiled(config, ROOT / "torch-ext" / "flash_qla", ROOT / "flash_qla_tl",
                                                  tmp_path, [(1, 2, "bfloat16")], jobs=1)
    assert variant.name == build_hub.compiled_variant_name() and universal.name == "torch-universal"
    metadata = Metadata.read_from_file(variant / "metadata.json")
    assert metadata.python_depends == ["tvm-ffi"] and metadata.backend.backend_type == Backend.CUDA
    assert Metadata.read_from_file(universal / "metadata.json").python_depends == []
    assert not (universal / "flash_qla_tl" / "shipped").exists()
    index = json.loads((variant / "flash_qla_tl" / "shipped" / INDEX_NAME).read_text())
    assert index["head_configs"] == [[1, 2, "bfloat16"]] and index["sms"] == list(SHIPPED_SMS)
    assert len(index["programs"]) == 1
    print_kernel_info(str(tmp_path))  # the metadata of whichever variant it reads first, and every backend
    assert {"Name: flash-qla", "Backends: cuda, universal"} <= set(capsys.readouterr().out.splitlines())

    script = textwrap.dedent("""
        import importlib, sys
        sys.modules["tilelang"] = None
        from kernels import get_kernel
        flash_qla = get_kernel("qwen/flash-qla", version=1)
        shipped = importlib.import_module(flash_qla.__name__ + ".flash_qla_tl.kernels.shipped")
        print(flash_qla.__file__, shipped.covers_head_config(1, 2, "bfloat16", 132))
    """)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
           "LOCAL_KERNELS": f"qwen/flash-qla={variant}"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == [str(variant / "__init__.py"), "True"]
