"""The weight files of a Hugging Face checkpoint folder: ``model.safetensors``,
or shards listed by ``model.safetensors.index.json`` (what ``save_pretrained``
writes), read header by header into {key: where its bytes are}."""
import json
import os
from typing import Dict

from .safetensors_format import TensorEntry, read_header

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointFilesError(FileNotFoundError):
    """A checkpoint folder without its weight files, or with an index naming files or keys it lacks."""


def checkpoint_entries(folder: str) -> Dict[str, TensorEntry]:
    """{state-dict key: TensorEntry} of every tensor of the checkpoint in ``folder``."""
    if not os.path.isdir(folder):
        raise CheckpointFilesError(f"checkpoint folder {folder!r} does not exist or is not a directory")
    index_path = os.path.join(folder, INDEX_FILE)
    single_path = os.path.join(folder, SINGLE_FILE)
    if os.path.isfile(index_path):
        return _sharded_entries(folder, index_path)
    if os.path.isfile(single_path):
        return read_header(single_path)[0]
    present = sorted(os.listdir(folder))
    raise CheckpointFilesError(
        f"checkpoint folder {folder!r} has neither {SINGLE_FILE} nor {INDEX_FILE} (it holds {present}); "
        f"shardtorch reads safetensors checkpoints, the format save_pretrained writes by default")


def _sharded_entries(folder: str, index_path: str) -> Dict[str, TensorEntry]:
    try:
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointFilesError(f"{index_path}: not a safetensors index (a JSON object with a 'weight_map' "
                                   f"{{key: file}}): {error!r}") from error
    by_file: Dict[str, list] = {}
    for key, name in weight_map.items():
        by_file.setdefault(name, []).append(key)
    entries = {}
    for name, keys in sorted(by_file.items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise CheckpointFilesError(f"{index_path} maps {len(keys)} key(s) (e.g. {keys[0]!r}) to {name!r}, "
                                       f"which is missing from {folder!r}")
        in_file = read_header(path)[0]
        for key in keys:
            if key not in in_file:
                raise CheckpointFilesError(f"{index_path} maps {key!r} to {name!r}, which does not hold it")
            entries[key] = in_file[key]
    return entries
