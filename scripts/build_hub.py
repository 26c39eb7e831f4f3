#!/usr/bin/env python3
"""Build the Hugging Face kernel-hub package of flash-qla (standard library only).

    python scripts/build_hub.py                         # -> build/torch-cuda/
    python scripts/build_hub.py --out DIR               # -> DIR/build/torch-cuda/
    python scripts/build_hub.py --compiled --jobs 16    # -> build/tvm-ffi01-cu130-x86_64-linux/ + torch-universal/
    python scripts/build_hub.py --source-tree DIR       # kernel-builder source for Nix

A variant directory holds what kernel-builder's torch-noarch build would: the
files of torch-ext/flash_qla/, a generated `_ops.py` (the op namespace) and
`metadata.json`, and here also the library `flash_qla_tl/`, vendored into the
package at build time (it uses relative imports only, which is checked).
Load it with `LOCAL_KERNELS=qwen/flash-qla=<DIR>` and `kernels.get_kernel`.

``--compiled`` builds the arch-specific variant instead: the same package with
every program of the shipped head configs compiled (``export_programs.py``:
TileLang and nvcc here, neither for the user), named for what it needs at run
time, apache-tvm-ffi and a CUDA driver of the toolkit that built the cubins
(`tvm-ffi01-cu130-x86_64-linux`); beside it the pure-Python package as
`torch-universal`, for every other system (there TileLang compiles at first use
where it is installed, else the PyTorch path runs).  `kernels` prefers an arch
variant to a universal one; a `torch-cuda` noarch variant would tie with a cu130
arch variant in its ordering, and then which one loads is left to chance.

The source tree is the same package without the generated files, plus
build.toml and flake.nix: Nix builds only see torch-ext/, so the library has
to be vendored before `nix build` runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = "flash_qla_tl"
BYTECODE = shutil.ignore_patterns("__pycache__", "*.pyc")

# kernel-builder's torch-noarch `_ops.py` template: a namespace unique to this
# build, so that two builds of the kernel can be loaded in one process.
OPS_PY = '''import torch


def get_backend() -> str:
    """Detect the backend by inspecting torch."""
    if hasattr(torch.backends, "tpu"):
        return "tpu"
    elif hasattr(torch, "neuron"):
        return "neuron"
    elif torch.version.cuda is not None:
        return "cuda"
    elif torch.version.hip is not None:
        return "rocm"
    elif torch.backends.mps.is_available():
        return "metal"
    elif hasattr(torch.version, "xpu") and torch.version.xpu is not None:
        return "xpu"
    return "cpu"


_OPS_NAME = f"_{kernel_name}_{{get_backend()}}_{unique_id}"

ops = getattr(torch.ops, _OPS_NAME)


def add_op_namespace_prefix(op_name: str) -> str:
    """Prefix op by namespace."""
    return f"{{_OPS_NAME}}::{{op_name}}"
'''

ABSOLUTE_SELF_IMPORT = re.compile(rf"^\s*(from|import)\s+{LIBRARY}\b", re.MULTILINE)


def source_files(directory: Path) -> list[Path]:
    """The files a build copies: everything but bytecode."""
    return sorted(
        p for p in directory.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    )


def check_vendorable(library: Path) -> None:
    """A vendored copy is imported as `<package>.flash_qla_tl`: absolute self-imports would escape it."""
    offenders = [
        str(p.relative_to(ROOT))
        for p in source_files(library)
        if p.suffix == ".py" and ABSOLUTE_SELF_IMPORT.search(p.read_text())
    ]
    if offenders:
        sys.exit(f"{LIBRARY} must use relative imports to be vendored; absolute imports in: {', '.join(offenders)}")


def content_id(*directories: Path) -> str:
    """A short hash of the sources, so each distinct build gets its own op namespace."""
    digest = hashlib.sha256()
    for directory in directories:
        for path in source_files(directory):
            digest.update(str(path.relative_to(ROOT)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:10]


def copy_package(package: Path, library: Path, destination: Path) -> None:
    """torch-ext/<package> with the library inside it, as a fresh directory."""
    if destination.exists():
        shutil.rmtree(destination)
    shutil.copytree(package, destination, ignore=BYTECODE)
    shutil.copytree(library, destination / LIBRARY, ignore=BYTECODE)


def metadata(config: dict, backend: str, kernel_id: str, python_depends: tuple = ()) -> dict:
    """metadata.json as kernel-builder writes it for one backend of a kernel."""
    general = config["general"]
    noarch = config["torch-noarch"]
    archs = {"cuda": noarch.get("cuda_capabilities"), "rocm": noarch.get("rocm_archs")}.get(backend)
    backend_info = {"type": backend} if archs is None else {"type": backend, "archs": archs}
    return {
        "name": general["name"],
        "id": kernel_id,
        "version": general["version"],
        "license": general["license"],
        "python-depends": general.get("python-depends", []) + general.get(backend, {}).get("python-depends", [])
        + list(python_depends),
        "backend": backend_info,
    }


def write_variant(config: dict, package: Path, library: Path, variant: Path, backend: str, unique_id: str,
                  python_depends: tuple = ()) -> Path:
    """One variant directory: the package with the library vendored, its op namespace and metadata."""
    module = package.name
    copy_package(package, library, variant)
    (variant / "_ops.py").write_text(OPS_PY.format(kernel_name=module, unique_id=unique_id))
    kernel_id = f"_{module}_{backend}_{unique_id}"
    (variant / "metadata.json").write_text(
        json.dumps(metadata(config, backend, kernel_id, python_depends), indent=2) + "\n")
    return variant


def build_variants(config: dict, package: Path, library: Path, out: Path) -> list[Path]:
    unique_id = content_id(package, library)
    return [write_variant(config, package, library, out / "build" / f"torch-{backend}", backend, unique_id)
            for backend in config["general"]["backends"]]


def cuda_toolkit_version() -> tuple[int, int]:
    """(major, minor) of the nvcc that builds the cubins: users need a driver of that CUDA version or newer."""
    nvcc = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc"
    found = re.search(r"release (\d+)\.(\d+)", subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                                                             check=True).stdout)
    return int(found.group(1)), int(found.group(2))


def compiled_variant_name() -> str:
    """The arch variant's name as `kernels` parses it: tvm-ffi and CUDA versions, CPU and OS."""
    import tvm_ffi

    ffi_major, ffi_minor = tvm_ffi.__version__.split(".")[:2]
    cuda_major, cuda_minor = cuda_toolkit_version()
    return f"tvm-ffi{ffi_major}{ffi_minor}-cu{cuda_major}{cuda_minor}-{platform.machine()}-{platform.system().lower()}"


def build_compiled(config: dict, package: Path, library: Path, out: Path, head_configs: list, jobs: int) -> list[Path]:
    """The arch variant with ``head_configs``' programs exported into ``flash_qla_tl/shipped/``, and the
    pure-Python package beside it as `torch-universal` (module docstring)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import export_programs

    unique_id = content_id(package, library)
    variant = write_variant(config, package, library, out / "build" / compiled_variant_name(), "cuda", unique_id,
                            python_depends=("tvm-ffi",))
    export_programs.export(head_configs, variant / LIBRARY / "shipped", jobs)
    universal = write_variant(config, package, library, out / "build" / "torch-universal", "cuda", unique_id)
    return [variant, universal]


def directory_size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def build_source_tree(package: Path, library: Path, out: Path) -> None:
    copy_package(package, library, out / "torch-ext" / package.name)
    for name in ("build.toml", "flake.nix"):
        shutil.copy2(ROOT / name, out / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--out", type=Path, default=ROOT, help="directory to write build/ into (default: the repository)")
    target.add_argument("--source-tree", type=Path, help="write a vendored kernel-builder source tree here instead")
    parser.add_argument("--compiled", action="store_true",
                        help="the arch variant with compiled programs (needs tilelang, nvcc, gcc) and torch-universal")
    parser.add_argument("--heads", help="with --compiled: comma-separated HqkxHv (default: the Qwen3.5/3.6 configs)")
    parser.add_argument("--dtypes", default="bfloat16,float16", help="with --compiled: comma-separated dtypes")
    parser.add_argument("--jobs", type=int, default=1, help="with --compiled: compiling processes")
    args = parser.parse_args()

    config = tomllib.loads((ROOT / "build.toml").read_text())
    package = ROOT / "torch-ext" / config["general"]["name"].replace("-", "_")
    library = ROOT / LIBRARY
    check_vendorable(library)

    if args.source_tree:
        build_source_tree(package, library, args.source_tree)
        print(f"source tree: {args.source_tree}")
        return
    if args.compiled:
        sys.path.insert(0, str(ROOT))
        from flash_qla_tl.programs import QWEN_HEAD_CONFIGS, parse_head_configs

        heads = parse_head_configs(args.heads) if args.heads else list(QWEN_HEAD_CONFIGS)
        head_configs = [(hqk, hv, dtype) for hqk, hv in heads for dtype in args.dtypes.split(",")]
        variants = build_compiled(config, package, library, args.out, head_configs, args.jobs)
    else:
        variants = build_variants(config, package, library, args.out)
    for variant in variants:
        print(f"built {variant} ({directory_size(variant) / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
