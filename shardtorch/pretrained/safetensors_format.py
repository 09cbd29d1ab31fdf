"""The safetensors file format, read and written without the safetensors package.

A file is an 8-byte little-endian header length, a JSON header {name: {"dtype",
"shape", "data_offsets": [begin, end]}, "__metadata__": {...}} padded with
spaces to a multiple of 8 bytes, then the tensors' bytes, row-major and
little-endian, at their offsets from the end of the header.

shardtorch reads and writes it itself so that a rank reads exactly the bytes of
its slices into the tensors that keep them (no memory map, whose touched pages
would count against the process, no whole-tensor buffer), and so that a file is
written tensor by tensor: the header, which needs every offset, is known from
the shapes alone before the first tensor exists.
"""
import json
import os
import struct
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

DTYPES: Dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("U16", "uint16"),
                     ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)
NAMES: Dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}

_MAX_HEADER = 100 * 2**20  # the safetensors package's own bound on a header


class SafetensorsFormatError(ValueError):
    """A file that is not a valid safetensors file (named, with what is wrong)."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: where its bytes are."""
    path: str
    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    start: int  # absolute byte offset in the file

    @property
    def nbytes(self) -> int:
        count = 1
        for n in self.shape:
            count *= n
        return count * self.dtype.itemsize


def read_header(path: str) -> Tuple[Dict[str, TensorEntry], Dict[str, str]]:
    """({name: TensorEntry}, metadata) of the safetensors file ``path``."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise SafetensorsFormatError(f"{path}: not a safetensors file (shorter than its 8-byte header size)")
            (length,) = struct.unpack("<Q", raw)
            if length > min(_MAX_HEADER, size - 8):
                raise SafetensorsFormatError(f"{path}: not a safetensors file (header size {length} exceeds the file)")
            header = json.loads(f.read(length))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SafetensorsFormatError(f"{path}: cannot read a safetensors header: {error}") from error
    if not isinstance(header, dict):
        raise SafetensorsFormatError(f"{path}: the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + length
    entries = {}
    for name, info in header.items():
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(n) for n in info["shape"])
            begin, end = (int(n) for n in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as error:
            raise SafetensorsFormatError(f"{path}: entry {name!r} is malformed ({info!r}): {error!r}") from error
        entry = TensorEntry(path, name, dtype, shape, data_start + begin)
        if end - begin != entry.nbytes or data_start + end > size:
            raise SafetensorsFormatError(f"{path}: entry {name!r} ({info['dtype']}, shape {list(shape)}) has "
                                         f"data_offsets {[begin, end]} that do not match its size or the file")
        entries[name] = entry
    return entries, metadata


def build_header(tensors: List[Tuple[str, torch.dtype, Tuple[int, ...]]],
                 metadata: Optional[Dict[str, str]] = None) -> Tuple[bytes, Dict[str, int]]:
    """(the header bytes, {name: byte offset in the file}) of a file holding
    ``tensors`` [(name, dtype, shape)] in that order."""
    header = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    relative = {}
    for name, dtype, shape in tensors:
        if dtype not in NAMES:
            raise ValueError(f"safetensors: cannot store dtype {dtype} of {name!r}")
        count = 1
        for n in shape:
            count *= n
        size = count * dtype.itemsize
        header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        relative[name] = offset
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    prefix = struct.pack("<Q", len(raw)) + raw
    return prefix, {name: len(prefix) + start for name, start in relative.items()}
