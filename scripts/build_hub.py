#!/usr/bin/env python3
"""Build the Hugging Face kernel-hub package of flash-qla (standard library only).

    python scripts/build_hub.py                         # -> build/torch-cuda/
    python scripts/build_hub.py --out DIR               # -> DIR/build/torch-cuda/
    python scripts/build_hub.py --source-tree DIR       # kernel-builder source for Nix

A variant directory holds what kernel-builder's torch-noarch build would: the
files of torch-ext/flash_qla/, a generated `_ops.py` (the op namespace) and
`metadata.json`, and here also the library `flash_qla_tl/`, vendored into the
package at build time (it uses relative imports only, which is checked).
Load it with `LOCAL_KERNELS=qwen/flash-qla=<DIR>` and `kernels.get_kernel`.

The source tree is the same package without the generated files, plus
build.toml and flake.nix: Nix builds only see torch-ext/, so the library has
to be vendored before `nix build` runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
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


def metadata(config: dict, backend: str, kernel_id: str) -> dict:
    """metadata.json as kernel-builder writes it for one backend of a torch-noarch kernel."""
    general = config["general"]
    noarch = config["torch-noarch"]
    archs = {"cuda": noarch.get("cuda_capabilities"), "rocm": noarch.get("rocm_archs")}.get(backend)
    backend_info = {"type": backend} if archs is None else {"type": backend, "archs": archs}
    return {
        "name": general["name"],
        "id": kernel_id,
        "version": general["version"],
        "license": general["license"],
        "python-depends": general.get("python-depends", []) + general.get(backend, {}).get("python-depends", []),
        "backend": backend_info,
    }


def build_variants(config: dict, package: Path, library: Path, out: Path) -> list[Path]:
    module = package.name
    unique_id = content_id(package, library)
    variants = []
    for backend in config["general"]["backends"]:
        variant = out / "build" / f"torch-{backend}"
        copy_package(package, library, variant)
        (variant / "_ops.py").write_text(OPS_PY.format(kernel_name=module, unique_id=unique_id))
        kernel_id = f"_{module}_{backend}_{unique_id}"
        (variant / "metadata.json").write_text(json.dumps(metadata(config, backend, kernel_id), indent=2) + "\n")
        variants.append(variant)
    return variants


def build_source_tree(package: Path, library: Path, out: Path) -> None:
    copy_package(package, library, out / "torch-ext" / package.name)
    for name in ("build.toml", "flake.nix"):
        shutil.copy2(ROOT / name, out / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--out", type=Path, default=ROOT, help="directory to write build/ into (default: the repository)")
    target.add_argument("--source-tree", type=Path, help="write a vendored kernel-builder source tree here instead")
    args = parser.parse_args()

    config = tomllib.loads((ROOT / "build.toml").read_text())
    package = ROOT / "torch-ext" / config["general"]["name"].replace("-", "_")
    library = ROOT / LIBRARY
    check_vendorable(library)

    if args.source_tree:
        build_source_tree(package, library, args.source_tree)
        print(f"source tree: {args.source_tree}")
        return
    for variant in build_variants(config, package, library, args.out):
        print(f"built {variant}")


if __name__ == "__main__":
    main()
