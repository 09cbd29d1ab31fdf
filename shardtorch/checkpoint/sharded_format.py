"""On-disk layout of a sharded checkpoint, and its atomic writes.

    <path>/LATEST                     name of the committed version, written last
    <path>/<version>/index.json       every entry: full shape, dtype, split dim,
                                      and which file holds which slice
    <path>/<version>/rank-00003.pt    torch.save of {key: shard} of one rank

A save writes a fresh <version> directory, every file through a temporary name
and os.replace (so a file is either absent or complete), then the index, and
only then LATEST. A save that dies at any point leaves LATEST naming the
previous version, which therefore stays loadable; a version directory without
its index is never read.
"""
import json
import os
import uuid
from typing import Any, Dict

FORMAT = "shardtorch-sharded-checkpoint"
FORMAT_VERSION = 1
LATEST = "LATEST"
INDEX = "index.json"


VERSION_PREFIX = "version-"


def new_version_name() -> str:
    return f"{VERSION_PREFIX}{uuid.uuid4().hex[:12]}"


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def write_atomically(path: str, write) -> None:
    """Calls ``write(file)`` on a temporary file, flushes it to disk, then
    renames it to ``path`` (a reader sees the old file or the whole new one)."""
    temporary = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(temporary, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    _fsync_directory(os.path.dirname(path) or ".")


def _fsync_directory(directory: str) -> None:
    # Makes the rename itself durable (the directory entry), where supported.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomically(path: str, value: Dict[str, Any]) -> None:
    write_atomically(path, lambda f: f.write(json.dumps(value, indent=1, sort_keys=True).encode()))


class CheckpointFormatError(RuntimeError):
    """A sharded checkpoint that is incomplete, corrupt or not one at all."""


def committed_version(path: str) -> str:
    """The directory of the last complete save at ``path``."""
    latest = os.path.join(path, LATEST)
    if not os.path.isdir(path):
        raise CheckpointFormatError(f"load_sharded: no checkpoint directory at {path!r}")
    if not os.path.exists(latest):
        if os.path.exists(os.path.join(path, INDEX)) or \
                os.path.basename(os.path.normpath(path)).startswith(VERSION_PREFIX):
            return path  # a version directory given directly (read_index checks it)
        raise CheckpointFormatError(
            f"load_sharded: {path!r} holds no committed checkpoint ({LATEST} is missing): "
            f"no save to it has completed")
    with open(latest) as f:
        version = f.read().strip()
    directory = os.path.join(path, version)
    if not version or not os.path.isfile(os.path.join(directory, INDEX)):
        raise CheckpointFormatError(f"load_sharded: {latest} names version {version!r}, "
                                    f"whose {INDEX} is missing")
    return directory


def read_index(directory: str) -> Dict[str, Any]:
    path = os.path.join(directory, INDEX)
    if not os.path.isfile(path):
        raise CheckpointFormatError(
            f"load_sharded: {directory!r} has no {INDEX}: an incomplete save (interrupted before "
            f"its commit), or not a shardtorch sharded checkpoint")
    try:
        with open(path) as f:
            index = json.load(f)
    except ValueError as e:
        raise CheckpointFormatError(f"load_sharded: {path} is not valid JSON ({e})") from None
    if index.get("format") != FORMAT or index.get("format_version") != FORMAT_VERSION:
        raise CheckpointFormatError(
            f"load_sharded: {path} is not a {FORMAT} version {FORMAT_VERSION} index "
            f"(format={index.get('format')!r}, format_version={index.get('format_version')!r})")
    return index


def check_files(directory: str, index: Dict[str, Any]) -> None:
    """Every file the index names exists with the size it was written with."""
    for name, expected in sorted(index["files"].items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise CheckpointFormatError(f"load_sharded: shard file {path} is missing "
                                        f"(the index lists it with {expected['bytes']} bytes)")
        size = os.path.getsize(path)
        if size != expected["bytes"]:
            raise CheckpointFormatError(f"load_sharded: shard file {path} has {size} bytes but was "
                                        f"written with {expected['bytes']}: truncated or overwritten")
