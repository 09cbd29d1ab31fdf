"""Reading a rank's slices of safetensors tensors straight into the tensors that keep them.

A slice is a list of pieces (offset, length) along one dimension of the whole
tensor, in the order the shard stores them (shardtorch.utils.shard_facts). Where
the pieces are runs of whole rows of the file (the split dimension is the first
one of size above 1), each is one read into its place in the destination: no
buffer. Otherwise (columns of a matrix), whole rows of the file are read a
bounded block at a time (mapped from the file, unmapped after) and the pieces
copied out of it. A destination of another dtype or device goes through a
bounded staging block.
"""
import math
import mmap
import os
import warnings
from typing import List, Optional, Sequence, Tuple

import torch

from .safetensors_format import TensorEntry

#: Bytes of the one staging block a read may use (read at each call, so tests may change it).
BLOCK_BYTES = 16 << 20


def _pread_into(fd: int, target: torch.Tensor, offset: int, path: str) -> None:
    """Fills the contiguous CPU tensor ``target`` with the file's bytes at ``offset``."""
    view = memoryview(target.reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], offset + done)
        if count <= 0:
            raise OSError(f"{path}: unexpected end of file reading {len(view)} bytes at offset {offset}")
        done += count


def read_pieces(entry: TensorEntry, out: torch.Tensor, dim: Optional[int] = None,
                pieces: Optional[List[Tuple[int, int]]] = None, fd: Optional[int] = None) -> None:
    """Fills ``out`` with ``pieces`` [(offset, length)] along ``dim`` of the
    file's tensor ``entry`` (None: the whole tensor), converting to ``out``'s
    dtype and device. ``fd``: an open descriptor of ``entry.path`` to reuse."""
    shape = entry.shape
    if dim is None:
        dim, pieces = 0, [(0, shape[0] if shape else 1)]
        shape = shape or (1,)
    expected = list(shape)
    expected[dim] = sum(length for _, length in pieces)
    if list(out.shape or (1,)) != expected or not out.is_contiguous():
        raise ValueError(f"read_pieces: {entry.name!r} in {entry.path}: the destination must be contiguous with "
                         f"shape {tuple(expected)}, got {tuple(out.shape)}")
    own = fd is None
    if own:
        fd = os.open(entry.path, os.O_RDONLY)
    try:
        _read(entry, out, shape, dim, pieces, fd)
    finally:
        if own:
            os.close(fd)


def _read(entry, out, shape, dim, pieces, fd) -> None:
    if out.numel() == 0:
        return
    outer, length, inner = math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1:])
    element = entry.dtype.itemsize
    local = out.view(outer, sum(count for _, count in pieces), inner)
    direct = out.dtype == entry.dtype and out.device.type == "cpu"
    if outer == 1:  # each piece is a contiguous run of the file and of the destination
        at = 0
        for offset, count in pieces:
            target = local[0, at:at + count].reshape(-1)
            start = entry.start + offset * inner * element
            if direct:
                _pread_into(fd, target, start, entry.path)
            else:
                _staged(fd, target, start, entry, element)
            at += count
        return
    row = length * inner  # elements of one index of the leading dimensions
    rows = max(1, (BLOCK_BYTES // element) // max(row, 1))
    for first in range(0, outer, rows):
        _copy_rows(fd, entry, first, min(rows, outer - first), length, inner, pieces, local)


def _copy_rows(fd: int, entry: TensorEntry, first: int, take: int, length: int, inner: int, pieces,
               local: torch.Tensor) -> None:
    """Copies the pieces of rows [first, first + take) of the file's tensor into ``local``, through a map of
    those rows (their pages read as the copy touches them: one copy, no staging buffer), unmapped after."""
    count = take * length * inner
    start = entry.start + first * length * inner * entry.dtype.itemsize
    aligned = start - start % mmap.ALLOCATIONGRANULARITY
    region = mmap.mmap(fd, start - aligned + count * entry.dtype.itemsize, flags=mmap.MAP_SHARED,
                       prot=mmap.PROT_READ, offset=aligned)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only buffer: the tensor over it is only read
        block = torch.frombuffer(region, dtype=entry.dtype, count=count, offset=start - aligned)
    rows = block.view(take, length, inner)
    at = 0
    for offset, pieces_count in pieces:
        local[first:first + take, at:at + pieces_count].copy_(rows[:, offset:offset + pieces_count])
        at += pieces_count
    del rows, block  # no view of the map may outlive it
    region.close()


def _staged(fd: int, target: torch.Tensor, start: int, entry: TensorEntry, element: int) -> None:
    """A contiguous run of the file into ``target`` (another dtype or device) through bounded blocks."""
    step = max(1, BLOCK_BYTES // element)
    block = torch.empty(min(step, target.numel()), dtype=entry.dtype)
    for first in range(0, target.numel(), step):
        take = min(step, target.numel() - first)
        _pread_into(fd, block[:take], start + first * element, entry.path)
        target[first:first + take].copy_(block[:take])


def map_run(entry: TensorEntry, shape: Sequence[int], first: int) -> torch.Tensor:
    """A CPU tensor of ``shape`` (the file's dtype) over the file's bytes from
    element ``first`` of ``entry`` on, mapped copy-on-write: pages are read
    from the file only when touched, stay shared page cache while only read
    (ranks on one node share them), and become the process's own when written
    (an optimizer step). Nothing is read now."""
    count = math.prod(shape)
    start = entry.start + first * entry.dtype.itemsize
    aligned = start - start % mmap.ALLOCATIONGRANULARITY
    length = start - aligned + count * entry.dtype.itemsize
    with open(entry.path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), length, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                           offset=aligned)
    return torch.frombuffer(mapped, dtype=entry.dtype, count=count, offset=start - aligned).view(tuple(shape))
