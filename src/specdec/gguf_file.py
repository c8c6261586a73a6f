"""A GGUF file's header, parsed here, and its tensors, memory-mapped.

`GGUFFile` parses the header itself and maps the file: the gguf package's `GGUFReader` turns
every element of the tokenizer's arrays into a numpy object, which takes seconds to a minute
for a 50k-260k vocabulary, while the header holds a few thousand scalars and a tensor table.
models.py reads a file's facts from it; the native backend's gguf.py reads its tensors.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from specdec.errors import SpecdecError


@dataclass(frozen=True)
class QuantTensor:
    """One GGUF tensor, undecoded."""

    name: str  # the GGUF name, e.g. "blk.3.attn_q.weight"
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # PyTorch order: [N, K] for a matrix (N rows of K), [K] for a vector
    data: np.ndarray  # the file's bytes: [N, bytes per row] uint8 for block types, [N, K] for floats

    def dequantize(self) -> np.ndarray:
        """The reference floats (the gguf package's own decoder), fp32 in `shape`."""
        return np.asarray(dequantize(np.asarray(self.data), self.qtype), dtype=np.float32).reshape(self.shape)

    def rows(self, index: np.ndarray) -> np.ndarray:
        """The reference floats of rows `index` only (an embedding lookup), fp32 [len(index), K]."""
        return np.asarray(dequantize(np.asarray(self.data[index]), self.qtype), dtype=np.float32).reshape(
            len(index), *self.shape[1:])



# GGUF metadata value types: fixed-size scalars (struct format), 8 = string, 9 = array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
# types held as numpy floats; every other (BF16 included, as the gguf package reads it) is raw
# bytes, [N, bytes per row]
_FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16}


@dataclass
class StringArray:
    """A metadata array of strings, decoded on first use (a tokenizer's 262k tokens cost time)."""

    blob: np.ndarray = field(repr=False)
    offset: int
    count: int

    def values(self) -> list[str]:
        out, pos = [], self.offset
        for _ in range(self.count):
            value, pos = _string(self.blob, pos)
            out.append(value)
        return out


class GGUFFile:
    """A GGUF file's metadata (`meta`) and tensors (`tensor`), memory-mapped."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.blob = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise SpecdecError(f"cannot read GGUF file {str(path)!r}: {e}", "target") from None
        try:
            self.metadata, self.tensors = self._parse()
        except (struct.error, ValueError, IndexError, UnicodeDecodeError) as e:
            raise SpecdecError(f"{self.path.name} is not a readable GGUF file ({e})", "target") from None

    def release(self, names) -> None:
        """Drop the mapped pages of tensors `names` (GGUF names) from this process's resident
        memory: for tensors the backend copied (repacked or dequantized), whose mapped bytes
        it no longer reads. Pages stay in the OS page cache (shared, not this process's);
        a later read faults them back in from there. Only whole pages inside a tensor's
        bytes are dropped, so a neighbour's pages stay where they were."""
        page, mapping = mmap.PAGESIZE, self.blob._mmap  # numpy's mmap.mmap behind the memmap
        advice = getattr(mmap, "MADV_DONTNEED", None)  # POSIX only (not on Windows)
        if mapping is None or advice is None:
            return
        for name in names:
            data = self.tensors[name].data
            start = data.__array_interface__["data"][0] - self.blob.__array_interface__["data"][0]
            first, last = -(-start // page) * page, (start + data.nbytes) // page * page
            if last > first:
                mapping.madvise(advice, first, last - first)

    def meta(self, key: str, default=None):
        """A metadata value: a scalar, a str, a numpy array, or a StringArray."""
        return self.metadata.get(key, default)

    def _parse(self) -> tuple[dict, dict[str, QuantTensor]]:
        blob = self.blob
        if bytes(blob[:4]) != b"GGUF":
            raise ValueError("no GGUF magic")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", blob, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}")
        metadata, pos = {}, 24
        for _ in range(kv_count):
            key, pos = _string(blob, pos)
            (kind,), pos = struct.unpack_from("<I", blob, pos), pos + 4
            metadata[key], pos = _value(blob, pos, kind)
        infos = []
        for _ in range(tensor_count):
            name, pos = _string(blob, pos)
            (dims,), pos = struct.unpack_from("<I", blob, pos), pos + 4
            ne = struct.unpack_from(f"<{dims}Q", blob, pos)
            kind, offset = struct.unpack_from("<IQ", blob, pos + 8 * dims)
            infos.append((name, ne, kind, offset))
            pos += 8 * dims + 12
        align = int(metadata.get("general.alignment", 32))
        start = -(-pos // align) * align
        return metadata, {name: self._tensor(name, ne, kind, start + offset)
                          for name, ne, kind, offset in infos}

    def _tensor(self, name: str, ne: tuple[int, ...], kind: int, offset: int) -> QuantTensor:
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise SpecdecError(f"tensor {name!r} has unknown GGUF type id {kind}", "target") from None
        shape = tuple(int(n) for n in reversed(ne))  # PyTorch order: rows last in the file's ne
        rows, width = math.prod(shape[:-1]), shape[-1]
        block, size = GGML_QUANT_SIZES[qtype]
        row_bytes = width // block * size
        data = self.blob[offset : offset + rows * row_bytes]
        if qtype.name in _FLOAT_DTYPES:
            data = data.view(_FLOAT_DTYPES[qtype.name]).reshape(shape)  # [N, K] (or [K]) of the float type
        else:
            data = data.reshape(rows, row_bytes)  # [N, bytes per row]
        return QuantTensor(name, qtype, shape, data)


def _string(blob: np.ndarray, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", blob, pos)
    return bytes(blob[pos + 8 : pos + 8 + n]).decode("utf-8"), pos + 8 + n


def _value(blob: np.ndarray, pos: int, kind: int):
    if kind in _SCALARS:
        return struct.unpack_from(_SCALARS[kind], blob, pos)[0], pos + struct.calcsize(_SCALARS[kind])
    if kind == 8:
        return _string(blob, pos)
    if kind != 9:
        raise ValueError(f"metadata type {kind}")
    item, count = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if item in _NUMPY:
        width = np.dtype(_NUMPY[item]).itemsize
        return np.asarray(blob[pos : pos + count * width]).view(_NUMPY[item]), pos + count * width
    if item == 8:
        array, end = StringArray(blob, pos, count), pos
        for _ in range(count):  # only the lengths are read to find the end
            (n,) = struct.unpack_from("<Q", blob, end)
            end += 8 + n
        return array, end
    raise ValueError(f"metadata array of type {item}")


@cache
def open_gguf(path: str, size: int, mtime_ns: int) -> GGUFFile:
    """One parsed file per path and version (a target and its draft may name the same file)."""
    return GGUFFile(path)


def gguf_file(path: str | Path) -> GGUFFile:
    stat = Path(path).stat()
    return open_gguf(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


# GGUF architecture -> the Hugging Face model_type the native backend knows it by
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text", "phi3": "phi3"}
