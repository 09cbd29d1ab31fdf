"""Proofs already done on this machine: a split proven exact is remembered by what decides it, so that
the next ``parallelize`` of the same model (the next launch of a job, a restart, another run of a
script) checks a key instead of running the probe batch again.

The key (one SHA-256) is made of what decides whether a split is exact: what the model computes
(model_identity.py: its modules, attributes, shapes, dtypes, tied parameters, hooks, config, and the
Python code it runs, utils/code_identity/), the plan as given ("auto" or the dict) and the plan the
model declares, the options (sequence parallelism, logits, the group's size and backend; the default
dtype, whether gradients and autocast are on) and the versions of Python, torch, transformers, peft,
timm and shardtorch (each of shardtorch's files by size and modification time). The weights are not
part of it: how a split reads weights does not depend on their values, as the proof on a miniature
already assumes. A model the key cannot describe (parallelize catches the error) is proven every time.

Only proofs that passed are kept (a refusal is proven again, its message fresh), with the warnings the
proof gave, said again on reuse, and the placements it proved (each module's name, style, layout and
variant): the plan resolved follows from what the key holds, so a kept proof also spares resolving it;
each placement is read again on the model (its layout's fit), and a kept plan that no longer fits is
resolved and proven anew. Every rank of the group must have the entry, under the same key and with the
same placements, for any to skip the proof: one all-gather, which also compares the first and last
values of every parameter, so that ranks holding different weights are still refused (what the
probe's digest checks otherwise).

Where: ``$SHARDTORCH_CACHE_DIR/proofs`` (default ``$XDG_CACHE_HOME/shardtorch``, else
``~/.cache/shardtorch``), one small JSON file per proof; ``SHARDTORCH_PROOF_CACHE=0`` turns reuse
off (every parallelize proves). A directory that cannot be written is not used.
"""
import hashlib
import json
import os
import sys
import tempfile
import warnings
from typing import Iterable, List, Optional, Tuple

import torch
from torch import nn

from ...distributed import collectives
from ...distributed import state
from .model_identity import model_digest
from .proof import refuse_different_models

_versions: Optional[bytes] = None


def directory() -> Optional[str]:
    """Where proofs are kept, or None when reuse is off."""
    if os.environ.get("SHARDTORCH_PROOF_CACHE", "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    root = os.environ.get("SHARDTORCH_CACHE_DIR")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "shardtorch")
    return os.path.join(root, "proofs")


def _package_files() -> List[str]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d != "__pycache__")
        for name in sorted(files):
            if name.endswith((".py", ".so", ".pyd")):
                path = os.path.join(folder, name)
                stat = os.stat(path)
                found.append(f"{os.path.relpath(path, root)} {stat.st_size} {stat.st_mtime_ns}")
    return found


def versions() -> bytes:
    """Python's, torch's, transformers', peft's, timm's and shardtorch's (its files), once per process."""
    global _versions
    if _versions is None:
        text = [sys.version, torch.__version__]
        for package in ("transformers", "peft", "timm"):
            module = sys.modules.get(package)
            text.append(f"{package} {getattr(module, '__version__', None)}")
        _versions = hashlib.sha256("\n".join(text + _package_files()).encode()).digest()
    return _versions


def key(model: nn.Module, plan, declared: dict, kind: str, options: dict, group: str,
        parameters: Optional[list] = None) -> str:
    """The key of ``model``'s split by ``plan`` (as given: "auto" or a dict; ``declared``: the plan the
    model declares, which "auto" reads), module docstring; ``kind``: "whole" (proven on the model itself)
    or "miniature" (on a miniature of its class). The plan resolved is not part of it: it follows from
    the model and the plan, and is kept with the proof. ``parameters``, a list, receives the parameters
    described (for ``agree``'s sample)."""
    h = hashlib.sha256(versions())
    h.update(kind.encode())
    h.update(model_digest(model, parameters))
    plan_text = repr(plan) if isinstance(plan, str) else repr(list(plan.items()))
    h.update(f"{plan_text}\0{sorted(declared.items())!r}\0".encode())
    backend = collectives_backend(group)
    h.update(repr((sorted(options.items()), state.get_group_size(group), backend, _context())).encode())
    return h.hexdigest()


def _context() -> tuple:
    """What the probe batch runs under besides the model: the default dtype (tensors a forward makes),
    gradients on or off (off, no gradient would be compared) and autocast."""
    autocast = tuple(torch.is_autocast_enabled(device) for device in ("cpu", "cuda"))
    return (torch.get_default_dtype(), torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast)


def collectives_backend(group: str) -> str:
    import torch.distributed as dist
    try:
        return str(dist.get_backend(state.get_group(group)))
    except Exception:  # noqa: BLE001 - a group of one without a backend
        return "none"


def _path(folder: str, digest: str) -> str:
    return os.path.join(folder, digest[:2], digest + ".json")


#: Proofs this process read or kept, by file: (warnings, placements) (each file parsed once; still there?
#: checked each time).
_known: dict = {}


def proven(digest: str) -> Optional[Tuple[List[str], list]]:
    """The warnings and placements (``placements_kept``) of the proof kept under ``digest``, or None."""
    folder = directory()
    if folder is None:
        return None
    path = _path(folder, digest)
    if path in _known and os.path.exists(path):  # a stat, not a parse
        said, placed = _known[path]
        return list(said), placed
    try:
        with open(path) as f:
            entry = json.load(f)
        if not isinstance(entry, dict) or entry.get("exact") is not True:
            return None
        said = [str(w) for w in entry.get("warnings", [])]
        placed = [(str(n), str(s), str(l), str(v), int(u), bool(d)) for n, s, l, v, u, d in entry["placements"]]
    except (OSError, ValueError, KeyError, TypeError):  # no entry, or one of another shape
        return None
    _known[path] = (said, placed)
    return list(said), placed


def placements_kept(placements) -> list:
    """What a proof keeps of each placement: (name, style, layout class, variant, unit, declared)."""
    return [(p.name, p.style, "" if p.layout is None else type(p.layout).__name__,
             repr(getattr(p.fit, "variant", None)), p.unit, p.declared) for p in placements]


def remember(digest: str, said: List[str], model: nn.Module, placements) -> None:
    """Keeps a passed proof with the placements it proved (written whole or not at all: a temporary file
    renamed)."""
    folder = directory()
    if folder is None:
        return
    path = _path(folder, digest)
    placed = placements_kept(placements)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"exact": True, "warnings": said, "model": type(model).__qualname__, "placements": placed}, f)
        os.replace(temporary, path)
        _known[path] = (list(said), placed)
    except OSError:  # a read-only or full disk: the proof is simply run again next time
        pass


def weights_sample(parameters: Iterable[torch.Tensor]) -> float:
    """A float64 digest of a few values of every parameter (its first and last elements, each weighted by
    its place): ranks built under different seeds, or from different files, differ in it."""
    values = []
    for p in parameters:
        if not p.is_floating_point() or p.is_meta:
            continue
        n = p.numel()
        if n == 0:
            continue
        if p.is_cpu and p.dtype in _NUMPY:
            flat = p.detach().numpy().flat  # no copy; indexing it costs a fraction of a tensor's
            values.extend((float(flat[0]), float(flat[n - 1])))
        else:
            values.extend(p.detach().reshape(-1)[[0, n - 1]].double().tolist())
    return sum(v * (1.0 + (i % 977) / 977.0) for i, v in enumerate(values))


_NUMPY = (torch.float64, torch.float32, torch.float16)


def agree(digest: Optional[str], kept: Optional[list], parameters: List[torch.Tensor], group: str) -> bool:
    """Whether every rank of ``group`` has the proof under the same key, with the same placements
    (``kept``: this rank's, or None), in one all-gather that every rank joins, with a key or without.
    Raises on every rank where all have it but their weights (``parameters``: those the key described)
    differ."""
    if kept is not None and digest is not None:
        digest = hashlib.sha256((digest + repr(kept)).encode()).hexdigest()
    found = kept is not None
    size = state.get_group_size(group)
    sample = 0.0
    if found:
        try:
            sample = weights_sample(parameters)
        except Exception:  # noqa: BLE001 - weights that cannot be sampled: proven instead
            found = False
        found = found and sample == sample  # a NaN compares with nothing: proven instead
    if size == 1:
        return found
    key_number = float(int(digest[:12], 16)) if digest else -1.0
    mine = torch.tensor([float(found), key_number, sample], dtype=torch.float64)
    everyone = [torch.zeros_like(mine) for _ in range(size)]
    collectives.all_gather(everyone, mine, group=state.get_group(group))
    if not all(t[0].item() == 1.0 and t[1].item() == mine[1].item() for t in everyone):
        return False
    refuse_different_models(group, [t[2].item() for t in everyone], "their parameters differ",
                            "a sample of every parameter's values, by group rank", floor=1.0)
    return True


def say_again(said: List[str]) -> None:
    for message in said:
        warnings.warn(message, stacklevel=4)
