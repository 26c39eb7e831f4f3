#!/usr/bin/env python3
"""Export compiled TileLang programs as self-contained shared libraries (build time; no GPU needed).

    python scripts/export_programs.py --heads 16x32,16x64 --out DIR --jobs 8

A TileLang program compiled with the tvm_ffi backend is host code (C: argument
checks, grid and TMA descriptor arithmetic) plus a CUDA module (cubin and what
each kernel takes), and it runs only beside TileLang's runtime library, which
loads that module and launches the kernels.  An exported program is one `.so`:
the same host code, the same cubin, and `program_launcher.c` in place of
TileLang's runtime (see its comment), built with gcc.  At run time it needs
apache-tvm-ffi and the CUDA driver, nothing else; ``flash_qla_tl.kernels.shipped``
loads it for ``compile_program`` (the index written here maps each program's key
to its file).

The programs are those ``flash_qla_tl.programs.head_config_programs`` lists for
each (head config, dtype): everything its launchers can ask for.  Exporting
compiles each program with TileLang first (its disk cache is reused).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from flash_qla_tl.kernels.compile import (  # noqa: E402
    HOPPER_TARGET, compile_with_tilelang, pass_configs_of, program_key,
)
from flash_qla_tl.kernels.shipped import INDEX_NAME, index_entry_name  # noqa: E402
from flash_qla_tl.programs import QWEN_HEAD_CONFIGS, SHIPPED_SMS, head_config_programs, parse_head_configs  # noqa: E402

LAUNCHER = Path(__file__).resolve().parent / "program_launcher.c"  # and its .h
LIBRARY_BIN = "__tvm_ffi__library_bin"
# program_launcher.c's enum fqla_arg, by DLPack type code and bits (TVM's pack_args.h)
ARG_ADDRESS, ARG_INT32, ARG_UINT32, ARG_FLOAT32, ARG_BY_VALUE = range(5)
DL_INT, DL_UINT, DL_FLOAT, DL_HANDLE, DL_GRID_CONSTANT = 0, 1, 2, 3, 30
LAUNCH_TAGS = {f"{scope}.{axis}": 3 * rank + i for rank, scope in enumerate(("blockIdx", "threadIdx"))
               for i, axis in enumerate("xyz")}
DYNAMIC_SHARED_MEMORY = "tirx.use_dyn_shared_memory"


# ---- reading what TileLang built ----

SECTION_HEADER = "<IIQQQQIIQQ"  # name, type, flags, address, offset, size, link, info, alignment, entry size


def section_headers(image: bytes | bytearray) -> tuple[list[list[int]], list[str]]:
    """A little-endian ELF64 file's section headers (each a list of its fields) and their names."""
    if image[:4] != b"\x7fELF" or image[4] != 2 or image[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    shoff, = struct.unpack_from("<Q", image, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", image, 0x3A)
    headers = [list(struct.unpack_from(SECTION_HEADER, image, shoff + i * shentsize)) for i in range(shnum)]
    names = headers[shstrndx][4]
    return headers, [bytes(image[names + h[0]:image.index(b"\0", names + h[0])]).decode() for h in headers]


def elf_symbol(path: Path, name: str) -> bytes:
    """The bytes of a defined symbol of an x86-64 ELF shared library, from its symbol tables."""
    data = path.read_bytes()
    sections, _ = section_headers(data)
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind not in (2, 11):  # SHT_SYMTAB, SHT_DYNSYM
            continue
        strings = sections[link][4]
        for at in range(offset, offset + size, entsize):
            st_name, _, _, st_shndx, st_value, st_size = struct.unpack_from("<IBBHQQ", data, at)
            end = data.index(b"\0", strings + st_name)
            if data[strings + st_name:end].decode() == name and st_shndx != 0:
                home = sections[st_shndx]  # file offset = value - section address + section offset
                start = st_value - home[3] + home[4]
                return data[start:start + st_size]
    raise ValueError(f"{path}: no symbol {name}")


class Reader:
    """TVM's binary serialisation: little-endian scalars, u64-counted strings and vectors."""

    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def scalar(self, fmt: str):
        value, = struct.unpack_from("<" + fmt, self.data, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def bytes(self) -> bytes:
        n = self.scalar("Q")
        self.at += n
        return self.data[self.at - n:self.at]

    def string(self) -> str:
        return self.bytes().decode()

    def vector(self, read):
        return [read() for _ in range(self.scalar("Q"))]


def cuda_module(library_bin: bytes) -> tuple[bytes, list[dict]]:
    """``(cubin, kernels)`` of the one CUDA module a TileLang library embeds (tvm_ffi's library_module.cc
    layout; TVM's CUDAModuleNode payload: format, FunctionInfo map, code)."""
    r = Reader(library_bin[8:8 + struct.unpack_from("<Q", library_bin)[0]])
    indptr = r.vector(lambda: r.scalar("Q"))
    r.vector(lambda: r.scalar("Q"))
    found = []
    for _ in range(len(indptr) - 1):
        kind = r.string()
        if kind != "_lib":
            found.append((kind, r.bytes()))
    if [kind for kind, _ in found] != ["cuda"]:
        raise ValueError(f"expected one embedded CUDA module, found {[kind for kind, _ in found]}")
    m = Reader(found[0][1])
    fmt = m.string()
    if fmt != "cubin":
        raise ValueError(f"the CUDA module holds {fmt!r}, not a cubin")
    kernels = []
    for _ in range(m.scalar("Q")):
        m.string()  # the map's key, the kernel's name again
        kernels.append({
            "name": m.string(),
            "arg_types": m.vector(lambda: (m.scalar("B"), m.scalar("B"), m.scalar("H"))),
            "launch_tags": m.vector(m.string),
            "extra_tags": m.vector(lambda: m.scalar("i")),
        })
    return m.bytes(), kernels


# Sections that only debuggers and profilers read: nvcc's line tables (TileLang always passes -lineinfo), the
# PTX text and their relocations; three quarters of a cubin's bytes.
DEBUG_PREFIXES = (".debug_", ".nv_debug_")
SHT_RELA, SHT_NOBITS = 4, 8
ALIGNMENT = 4096  # bytes are removed in whole pages, so every later section keeps its alignment


def strip_debug_sections(image: bytes) -> bytes:
    """The cubin ``image`` without its debug sections' contents: those sections and their relocations are
    emptied and their bytes cut out of the file, the offsets of what follows moved down.  Code, constants,
    kernel attributes and symbols are copied byte for byte (``tests/test_shipped.py`` compares them)."""
    out = bytearray(image)
    phoff, shoff = struct.unpack_from("<QQ", out, 0x20)
    phentsize, phnum, shentsize = struct.unpack_from("<HHH", out, 0x36)
    sections, names = section_headers(out)
    debug = {i for i, name in enumerate(names) if name.startswith(DEBUG_PREFIXES)}
    debug |= {i for i, s in enumerate(sections) if s[1] == SHT_RELA and s[7] in debug}
    spans = [(sections[i][4], sections[i][4] + sections[i][5]) for i in debug if sections[i][1] != SHT_RELA]
    if not spans:
        return image
    start, end = min(a for a, _ in spans), max(b for _, b in spans)
    for i, s in enumerate(sections):  # nothing else may live among the debug bytes
        if i not in debug and s[1] != SHT_NOBITS and s[5] and s[4] < end and s[4] + s[5] > start:
            raise ValueError(f"section {names[i]} lies among the debug sections")
    cut = (end - start) // ALIGNMENT * ALIGNMENT
    if not cut:
        return image
    moved = lambda offset: offset - cut if offset >= start + cut else offset  # noqa: E731
    for i, s in enumerate(sections):
        s[4] = start if i in debug else moved(s[4])
        if i in debug:
            s[5] = 0
    phoff, shoff = moved(phoff), moved(shoff)
    del out[start:start + cut]
    struct.pack_into("<QQ", out, 0x20, phoff, shoff)
    for i, s in enumerate(sections):
        struct.pack_into(SECTION_HEADER, out, shoff + i * shentsize, *s)
    for i in range(phnum):  # program headers: p_offset is the second 8-byte field after p_type, p_flags
        at = phoff + i * phentsize + 8
        struct.pack_into("<Q", out, at, moved(struct.unpack_from("<Q", out, at)[0]))
    return bytes(out)


def argument_codes(kernel: dict) -> list[int]:
    """How program_launcher.c passes each argument (TVM's conversion for its type, or a TMA descriptor)."""
    codes = []
    for i, (code, bits, lanes) in enumerate(kernel["arg_types"]):
        tensor_map = i < len(kernel["extra_tags"]) and kernel["extra_tags"][i] == 1
        conversion = {(DL_INT, 64): ARG_ADDRESS, (DL_INT, 32): ARG_INT32, (DL_UINT, 32): ARG_UINT32,
                      (DL_FLOAT, 64): ARG_ADDRESS, (DL_FLOAT, 32): ARG_FLOAT32}.get((code, bits))
        if tensor_map or code == DL_GRID_CONSTANT:
            conversion = ARG_BY_VALUE
        elif code == DL_HANDLE:
            conversion = ARG_ADDRESS
        if conversion is None or lanes != 1:
            raise ValueError(f"{kernel['name']}: argument {i} of type {(code, bits, lanes)} cannot be passed")
        codes.append(conversion)
    return codes


def kernel_table(kernels: list[dict]) -> str:
    """The C definition of FQLA_KERNELS for program_launcher.c."""
    rows = []
    for kernel in kernels:
        tags = kernel["launch_tags"]
        dynamic = bool(tags) and tags[-1] == DYNAMIC_SHARED_MEMORY
        launch = tags[:-1] if dynamic else tags
        unknown = [t for t in launch if t not in LAUNCH_TAGS]
        if unknown:  # clusters, programmatic dependent or cooperative launches: none of ours uses them
            raise ValueError(f"{kernel['name']}: launch tags {unknown} are not supported by the shipped launcher")
        codes = argument_codes(kernel)
        rows.append(f'  {{"{kernel["name"]}", {len(codes)}, {{{", ".join(map(str, codes)) or 0}}}, {len(launch)}, '
                    f'{{{", ".join(str(LAUNCH_TAGS[t]) for t in launch) or 0}}}, {int(dynamic)}}},')
    return "\n".join(['#include "program_launcher.h"', "fqla_kernel FQLA_KERNELS[] = {", *rows, "};",
                      f"const int FQLA_NUM_KERNELS = {len(rows)};", ""])


# ---- building the library ----

def include_dirs() -> list[str]:
    import tilelang
    import tvm_ffi.libinfo

    tvm_include = Path(tilelang.__file__).parent / "3rdparty" / "tvm" / "include"
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    return [str(tvm_include), tvm_ffi.libinfo.find_include_path(), tvm_ffi.libinfo.find_dlpack_include_path(),
            str(Path(cuda_home) / "include")]


def compile_flags() -> list[str]:
    return ["-O2", "-fPIC", "-fvisibility=hidden", f"-I{LAUNCHER.parent}", *(f"-I{d}" for d in include_dirs())]


@functools.lru_cache(maxsize=None)
def launcher_object() -> Path:
    """program_launcher.c compiled once per process (every library links the same object)."""
    out = Path(tempfile.mkdtemp(prefix="fqla-launcher-")) / "launcher.o"
    subprocess.run(["gcc", *compile_flags(), "-c", LAUNCHER, "-o", out], check=True)
    return out


def build_library(host_source: str, cubin: bytes, kernels: list[dict], out: Path) -> None:
    """Compile host code, kernel table and embedded cubin, and link them with the launcher into ``out`` (gcc)."""
    flags = compile_flags()
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        (work / "host.c").write_text(host_source)
        (work / "kernels.c").write_text(kernel_table(kernels))
        (work / "kernel.cubin").write_bytes(cubin)
        # the cubin as read-only data, 128-byte aligned (cuModuleLoadData takes the image's address)
        (work / "cubin.s").write_text(
            '.section .rodata\n.balign 128\n.globl fqla_cubin\n.hidden fqla_cubin\nfqla_cubin:\n'
            f'.incbin "{work / "kernel.cubin"}"\n.section .note.GNU-stack,"",@progbits\n')
        # the host code's exported entry points keep default visibility; everything of ours is hidden
        subprocess.run(["gcc", "-x", "c", *flags, "-fvisibility=default", "-DTVMBackendGetFuncFromEnv=fqla_get_func",
                        "-c", work / "host.c", "-o", work / "host.o"], check=True)
        for name in ("kernels.c", "cubin.s"):
            subprocess.run(["gcc", *flags, "-c", work / name, "-o", work / f"{name}.o"], check=True)
        # -s and one segment for code and data: no static symbol table, no page of padding between segments
        subprocess.run(["gcc", "-shared", "-s", "-Wl,-z,noseparate-code", "-o", out, work / "host.o",
                        work / "kernels.c.o", work / "cubin.s.o", launcher_object(), "-Wl,--no-as-needed", "-ldl",
                        "-lpthread"], check=True)


def export_program(build, config: tuple, out_dir: Path) -> tuple[str, str]:
    """Compile (or load from TileLang's cache) one program and write it to ``out_dir``: ``(key, file name)``.

    A library already there is kept (files appear whole: each is linked under another name, then renamed),
    so an interrupted export picks up where it stopped."""
    pass_configs = pass_configs_of(build)
    key = program_key(build, config, pass_configs)
    name = index_entry_name(key)
    if (out_dir / name).is_file():
        return key, name
    kernel = compile_with_tilelang(build, config, pass_configs)
    with tempfile.TemporaryDirectory() as work:  # TileLang's own library, freshly built or from its cache
        kernel.export_library(f"{work}/tilelang.so")
        cubin, kernels = cuda_module(elf_symbol(Path(work) / "tilelang.so", LIBRARY_BIN))
    partial = out_dir / f"{name}.partial"
    build_library(kernel.get_host_source(), strip_debug_sections(cubin), kernels, partial)
    partial.replace(out_dir / name)
    return key, name


def _export_task(task):
    build, config, out_dir = task
    start = time.perf_counter()
    key, name = export_program(build, config, out_dir)
    return key, name, f"{build.__name__}{config}: {time.perf_counter() - start:.1f} s"


def export(head_configs: list[tuple[int, int, str]], out_dir: Path, jobs: int = 1) -> dict:
    """Export every program of ``head_configs`` ((Hqk, Hv, dtype)) into ``out_dir`` with its index."""
    import tilelang

    out_dir.mkdir(parents=True, exist_ok=True)
    tasks = list(dict.fromkeys(task for hqk, hv, dtype in head_configs
                               for task in head_config_programs(hqk, hv, dtype)))
    programs = {}
    with ProcessPoolExecutor(jobs) as pool:
        for key, name, line in pool.map(_export_task, [(b, c, out_dir) for b, c in tasks]):
            programs[key] = name
            print(line, flush=True)
    index = {"tilelang": tilelang.__version__, "target": HOPPER_TARGET, "sms": list(SHIPPED_SMS),
             "head_configs": [list(h) for h in head_configs], "programs": programs}
    (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    return index


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", default=",".join(f"{hqk}x{hv}" for hqk, hv in QWEN_HEAD_CONFIGS),
                   help="comma-separated HqkxHv")
    p.add_argument("--dtypes", default="bfloat16,float16", help="comma-separated: bfloat16, float16")
    p.add_argument("--out", type=Path, required=True, help="directory for the libraries and their index")
    p.add_argument("--jobs", type=int, default=1, help="compiling processes")
    args = p.parse_args()
    heads = parse_head_configs(args.heads)
    configs = [(hqk, hv, dtype) for (hqk, hv), dtype in itertools.product(heads, args.dtypes.split(","))]
    start = time.perf_counter()
    index = export(configs, args.out, args.jobs)
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"{len(index['programs'])} programs, {size / 2**20:.1f} MiB, in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
