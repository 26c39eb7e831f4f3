"""Programs shipped compiled with the package: loaded without TileLang or nvcc.

An arch-specific build of the hub package (``scripts/build_hub.py --compiled``)
carries, in ``flash_qla_tl/shipped/``, one shared library per program of the
head configs it was built for (``scripts/export_programs.py``) and
``index.json``, which maps each program's key (``compile.program_key``) to its
file.  Loading one needs apache-tvm-ffi (the library's calling convention) and
the CUDA driver; nothing is compiled.  ``FLASH_QLA_SHIPPED_DIR`` points
elsewhere (tests, or a build kept outside the package).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

INDEX_NAME = "index.json"
DEFAULT_DIR = Path(__file__).resolve().parent.parent / "shipped"


def index_entry_name(key: str) -> str:
    """The file a program's library is shipped as: a hash of its key (keys are long and not file-safe)."""
    return hashlib.sha256(key.encode()).hexdigest()[:24] + ".so"


def shipped_dir() -> Path:
    return Path(os.environ.get("FLASH_QLA_SHIPPED_DIR", DEFAULT_DIR))


@functools.lru_cache(maxsize=None)
def _index(directory: Path) -> dict:
    path = directory / INDEX_NAME
    if not path.is_file():
        return {"programs": {}, "head_configs": []}
    return json.loads(path.read_text())


def index() -> dict:
    """The shipped programs' index (empty where this build ships none)."""
    return _index(shipped_dir())


def covers_head_config(num_qk_heads: int, num_v_heads: int, dtype: str, sms: int) -> bool:
    """Whether every program the launchers can ask for at this head config and dtype, on a GPU of ``sms``
    SMs, is shipped (``programs.head_config_programs``: the build exports exactly those, the persistent
    backward programs for each SM count it records)."""
    shipped = index()
    return [num_qk_heads, num_v_heads, dtype] in shipped["head_configs"] and sms in shipped.get("sms", ())


def has_program(key: str) -> bool:
    return key in index()["programs"]


def load_program(key: str):
    """The shipped program ``key`` as a callable taking the kernel's arguments, or None where not shipped."""
    name = index()["programs"].get(key)
    if name is None:
        return None
    import tvm_ffi

    return tvm_ffi.load_module(str(shipped_dir() / name))["main"]
