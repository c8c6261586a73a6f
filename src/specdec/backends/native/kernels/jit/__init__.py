"""The native backend's numba code: every module here compiles on first import (numba is the
`cpu` extra) and caches its machine code on disk.

numba checks a cached function against the time stamp of its own file only, while these
kernels inline code from their neighbours (ir.py's IR, norms.py into attention.py and
layer.py) and constants from quant_types.py and the tile layouts (kernels/tiles16.py,
kernels/supertiles.py). So the cache lives in a folder named after a
digest of all those sources: a change to any of them starts a new cache, never a stale one.
The folder is `$NUMBA_CACHE_DIR/specdec-<digest>` where numba's variable is set, else
`~/.cache/specdec/numba/<digest>`. Importing this package sets it, before any kernel module
(all of them live here) is compiled.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from numba.core import config

_HERE = Path(__file__).resolve().parent
_SOURCES = (*sorted(_HERE.glob("*.py")), _HERE.parents[1] / "quant_types.py", _HERE.parent / "tiles16.py",
            _HERE.parent / "supertiles.py")


def source_digest() -> str:
    """A digest of the kernels' sources (this folder, the quant-type table and the tile layouts)."""
    digest = hashlib.sha256(os.environ.get("SPECDEC_BF16_DOT", "").encode())  # a forced path: its own cache
    for path in _SOURCES:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def cache_dir() -> Path:
    base = os.environ.get("NUMBA_CACHE_DIR")
    if base:
        return Path(base) / f"specdec-{source_digest()}"
    return Path.home() / ".cache" / "specdec" / "numba" / source_digest()


config.CACHE_DIR = str(cache_dir())
