"""Parallelized models that no rank ever holds whole: ``ts.nn.from_pretrained``
(each rank reads its slices of a Hugging Face checkpoint) and
``ts.nn.from_config`` (each rank draws its slices of a fresh model's own
initialisation).

Both build the model with every sized tensor on the meta device
(shardtorch/pretrained/meta_build.py), run ``parallelize`` on it (shapes
only), give the parameters real tensors of their shard shapes
(pretrained/materialize.py) and fill them: from the checkpoint's bytes
(pretrained/safetensors_read.py), or by replaying the model's own init slice
by slice (pretrained/init_replay.py).
"""
import os
import warnings
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ...distributed import collectives
from ...pretrained.checkpoint_files import checkpoint_entries
from ...pretrained.safetensors_read import map_run, read_pieces
from ...distributed import state
from ...utils.shard_facts import named_parameter_shards
from .apply import parallelize
from ...pretrained.checkpoint_keys import Merged, converted_entries, read_merged
from ...pretrained.init_replay import replay, targets_of
from ...pretrained.materialize import materialize, named_tensors
from ...pretrained.meta_build import MetaBuildError, build_on_meta, build_recorded
from ...pretrained.model_source import default_dtype, resolve_dtype, source_from_config, source_from_folder
from .options_agree import check_options_agree, options_checked


def from_pretrained(model, path=None, *, dtype="auto", plan="auto", group: str = state.TENSOR_PARALLEL,
                    sequence_parallel: bool = False, verbose: bool = False, logits: str = "lazy", device="cpu",
                    mmap: bool = True, config=None, verify: bool = True, **config_overrides) -> nn.Module:
    """A parallelized model whose parameters each rank reads from a Hugging
    Face checkpoint folder, only its own slices: no rank ever holds the whole
    model (peak memory: its shards plus one bounded read block).

    Args:
        model: the checkpoint folder (its config.json names the transformers
            class, or a timm architecture), or a transformers class
            (``LlamaForCausalLM``) or a factory returning the model, with
            ``path`` the folder.
        path: the folder when ``model`` is a class or factory. It holds
            ``model.safetensors``, or shards listed by
            ``model.safetensors.index.json``, as ``save_pretrained`` writes.
        dtype: as transformers takes it: "auto" (the config's dtype, else the
            checkpoint's), a torch.dtype or its name.
        plan, group, sequence_parallel, verbose, logits: as ``ts.nn.parallelize``.
        verify: prove the split before anything is read, on a miniature of
            the model's class (docs/pretrained.md: the proof); False skips it.
        device: where the shards are allocated and read to.
        mmap: on the CPU, a parameter whose slice is one run of the file in
            its own dtype (a whole tensor, rows of a matrix) maps the file
            copy-on-write instead of reading it: its pages are read when first
            touched, stay shared page cache while only read (ranks on one
            node share them), and become the rank's own once written (an
            optimizer step). False: every slice is read into memory now.
        config: a config to use instead of the folder's; ``config_overrides``
            set attributes of the folder's config (``attn_implementation=...``).

    Each rank's tensors are bitwise the checkpoint's slices (converted when
    ``dtype`` differs from the checkpoint's). Buffers the model computes
    itself (rotary frequencies, position ids) are computed as its own init
    does. Weights the checkpoint lacks are initialised by the model's own
    init, drawn as one whole tensor each (each rank keeping its slices) from a
    generator seeded alike on every rank, and named in a warning, as
    transformers does. Returned in eval mode, as transformers returns it.

    Errors (a missing file, a shape that disagrees with the config, a
    checkpoint of another architecture, a group larger than the heads or the
    vocabulary) are raised on every rank, by every rank's verdict, before
    anything is read. Collective over the world.
    """
    who = "from_pretrained"
    if path is None:
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"{who}: give the checkpoint folder: from_pretrained(path) or "
                            f"from_pretrained(ModelClass, path), got model={model!r} and no path")
        path = model
    folder = os.fspath(path)
    check_options_agree(who, group, {"dtype": dtype, "plan": plan, "sequence_parallel": sequence_parallel,
                                     "verbose": verbose, "logits": logits, "verify": verify,
                                     "config_overrides": config_overrides})

    def prepare():
        entries = checkpoint_entries(folder)
        source = source_from_folder(folder, model, config, config_overrides, who)
        resolved = resolve_dtype(dtype, source.config, [e.dtype for e in entries.values()], who)
        with default_dtype(resolved):
            incomplete = False
            try:
                built, record = build_recorded(source.build, consume_random=False)
            except MetaBuildError:
                # An initialisation that needs real values: the checkpoint replaces them; the record then lacks
                # what such initialisers write (weights the checkpoint lacks cannot be drawn).
                (built, record), incomplete = build_on_meta(source.build), True
        if not _all_found(built, entries):  # a checkpoint in the model's original format
            entries = converted_entries(built, entries, who)  # transformers' renamings and merges of the keys
        keys = _match_keys(built, entries, source.description, folder)
        originals = named_tensors(built)
        missing, unexpected = _check_shapes(built, originals, entries, keys, folder)
        return built, record, incomplete, originals, keys, entries, missing, unexpected

    built, record, incomplete, originals, keys, entries, missing, unexpected = _agreed(prepare, who)
    # After the agreement: its refusals are the same on every rank (they read only the model), and verbose=True
    # makes a collective.
    with options_checked(group):
        parallelize(built, plan=plan, group=group, sequence_parallel=sequence_parallel, verbose=verbose,
                    logits=logits, verify=verify)
    reads = _read_plan(built, keys, entries)
    mapped = {}

    def provide(meta_tensor):
        read = reads.get(id(meta_tensor))
        if not mmap or read is None or not isinstance(meta_tensor, nn.Parameter) or torch.device(device).type != "cpu":
            return None
        run = read.run(meta_tensor)
        if run is None:
            return None
        mapped[id(meta_tensor)] = True
        return map_run(read.entry, tuple(meta_tensor.shape), run)

    meta = set(_agreed(lambda: materialize(built, device, provide), who))
    persistent = list(built.state_dict(keep_vars=True).keys())
    loaded = _agreed(lambda: _read_slices(built, reads, mapped), who)
    to_initialise = [name for name in persistent if name not in loaded and name in meta]
    computed = [name for name in meta if name not in persistent and name not in loaded]
    generator = _agreed_generator()
    if incomplete and to_initialise:
        raise MetaBuildError(f"{who}: {', '.join(to_initialise)} are not in {folder!r}, and the model's own "
                             f"initialisation cannot run on the meta device to draw them (it reads tensor values)")
    replay(record, targets_of(built, originals, to_initialise + computed), live=True, generator=generator, who=who)
    if missing:
        warnings.warn(f"{who}: {len(missing)} weight(s) of {type(built).__name__} are not in {folder!r} and are "
                      f"initialised by the model's own init: {', '.join(missing)}")
    if unexpected:
        warnings.warn(f"{who}: {len(unexpected)} tensor(s) of {folder!r} are not used by "
                      f"{type(built).__name__}: {', '.join(unexpected)}")
    _finish(built, folder)
    return built


def from_config(model, config=None, *, dtype=None, plan="auto", group: str = state.TENSOR_PARALLEL,
                sequence_parallel: bool = False, verbose: bool = False, logits: str = "lazy",
                device="cpu", verify: bool = True) -> nn.Module:
    """A fresh parallelized model, each rank holding exactly the slices that
    the unsharded model's own initialisation draws under the same
    ``torch.manual_seed`` (bitwise), without ever holding a whole tensor.

    ``model``: a transformers class (with ``config``) or a factory returning
    the model (``lambda: timm.create_model(...)``, a class taking ``config``).
    ``dtype``: the default dtype to build in (None: torch's); ``plan``,
    ``group``, ``sequence_parallel``, ``verbose``, ``logits``: as
    ``ts.nn.parallelize``; ``verify``: as ``from_pretrained``. Every random
    number the unsharded model's construction draws is drawn here too, in the
    same order, so the generator ends where the unsharded model's leaves it.
    What cannot be drawn slice by slice (a sharded parameter drawn in part,
    one computed from other random tensors) raises an error naming it.
    Collective over the world (errors are agreed before anything is drawn)."""
    who = "from_config"
    check_options_agree(who, group, {"dtype": dtype, "plan": plan, "sequence_parallel": sequence_parallel,
                                     "verbose": verbose, "logits": logits, "verify": verify})
    source = source_from_config(model, config, who)
    resolved = resolve_dtype(dtype, source.config, [], who)

    def prepare():
        with default_dtype(resolved):
            built, record = build_recorded(source.build, consume_random=True)
        return built, record, named_tensors(built)

    built, record, originals = _agreed(prepare, who)
    with options_checked(group):
        parallelize(built, plan=plan, group=group, sequence_parallel=sequence_parallel, verbose=verbose,
                    logits=logits, verify=verify)
    meta = materialize(built, "cpu")
    replay(record, targets_of(built, originals, meta), live=False, who=who)
    return built.to(device)


def _agreed(work, who: str):
    """Runs ``work`` on every rank; if any rank fails, every rank raises (its
    own error, or one naming the ranks that failed) instead of some ranks
    going on to a collective the others never reach."""
    error = None
    try:
        result = work()
    except Exception as caught:  # noqa: BLE001 - re-raised below on every rank
        error, result = caught, None
    problems = [None if error is None else f"{type(error).__name__}: {error}"]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        problems = [None] * dist.get_world_size()
        collectives.all_gather_object(problems, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(rank, problem) for rank, problem in enumerate(problems) if problem]
    if failed:
        raise RuntimeError(f"{who}: failed on other ranks: " + "; ".join(f"rank {r}: {p}" for r, p in failed))
    return result


def _agreed_generator() -> torch.Generator:
    """A CPU generator in the same state on every rank, seeded from rank 0's
    default generator (so ``torch.manual_seed`` before loading decides it)."""
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        collectives.broadcast(seed, src=0)
    return torch.Generator().manual_seed(int(seed))


def _all_found(model: nn.Module, entries) -> bool:
    """Whether every model key is in the checkpoint as it is (or under another name of its tensor)."""
    tied = _tied_names(model)
    return all(key in entries or any(other in entries for other in tied.get(key, ()))
               for key in model.state_dict(keep_vars=True))


def _match_keys(model: nn.Module, entries, description: str, folder: str) -> Dict[str, str]:
    """{model state-dict key: checkpoint key}: the same key, or with the base
    model's prefix added or removed (a checkpoint of ``LlamaModel`` loaded
    into ``LlamaForCausalLM`` and back), as transformers matches them."""
    model_keys = list(model.state_dict(keep_vars=True).keys())
    prefix = getattr(model, "base_model_prefix", "") or ""
    candidates = [lambda k: k]
    if prefix:
        candidates += [lambda k: k[len(prefix) + 1:] if k.startswith(prefix + ".") else None,
                       lambda k: f"{prefix}.{k}"]
    best: Dict[str, str] = {}
    for rename in candidates:
        found = {k: rename(k) for k in model_keys if rename(k) in entries}
        if len(found) > len(best):
            best = found
    if not best:
        raise ValueError(f"from_pretrained: no tensor of {folder!r} (e.g. {sorted(entries)[:3]}) is a weight of "
                         f"{description} (e.g. {model_keys[:3]}): a checkpoint of another architecture?")
    return best


def _ignored(model: nn.Module, attribute: str, key: str) -> bool:
    import re
    patterns = list(getattr(model, attribute, None) or [])
    patterns += [r"rotary_emb\.inv_freq", r"(^|\.)position_ids$"] if attribute.endswith("unexpected") else []
    return any(re.search(pattern, key) for pattern in patterns)


def _check_shapes(model, originals, entries, keys, folder) -> Tuple[List[str], List[str]]:
    """(missing keys, unexpected keys); raises on a shape that disagrees."""
    problems = []
    for name, key in keys.items():
        expected, found = tuple(originals[name].shape), entries[key].shape
        if expected != found:
            problems.append(f"{key!r} has shape {list(found)} in the checkpoint, the model's config gives "
                            f"{list(expected)}")
    if problems:
        raise ValueError(f"from_pretrained: {folder!r} does not fit {type(model).__name__}: " + "; ".join(problems))
    tied = _tied_names(model)
    missing = [name for name in model.state_dict(keep_vars=True) if name not in keys
               and not any(other in keys for other in tied.get(name, ()))
               and not _ignored(model, "_keys_to_ignore_on_load_missing", name)]
    used = set(keys.values())
    unexpected = [key for key in entries if key not in used
                  and not _ignored(model, "_keys_to_ignore_on_load_unexpected", key)]
    return missing, unexpected


def _tied_names(model: nn.Module) -> Dict[str, List[str]]:
    """{name: other names of the same tensor}."""
    by_tensor: Dict[int, List[str]] = {}
    for name, tensor in named_tensors(model).items():
        by_tensor.setdefault(id(tensor), []).append(name)
    return {name: [n for n in names if n != name] for names in by_tensor.values() for name in names}


class _Read:
    """Where one tensor of the model comes from: the file's tensor ``entry``,
    its slices ``pieces`` along ``dim`` (None: whole), under ``names``."""

    def __init__(self, entry, dim, pieces, names):
        self.entry, self.dim, self.pieces, self.names = entry, dim, pieces, names

    def run(self, tensor: torch.Tensor) -> Optional[int]:
        """The first element of the file's tensor from which ``tensor`` lies as
        one run of the file's bytes in its own dtype (so that it can be
        mapped); None where it does not."""
        if isinstance(self.entry, Merged) or tensor.dtype != self.entry.dtype or tensor.numel() == 0:
            return None
        if self.dim is None:
            return 0
        outer = 1
        for n in self.entry.shape[:self.dim]:
            outer *= n
        if outer != 1 or len(self.pieces) != 1:
            return None
        inner = tensor.numel() // max(tensor.shape[self.dim], 1)
        return self.pieces[0][0] * inner


def _read_plan(model: nn.Module, keys: Dict[str, str], entries) -> Dict[int, _Read]:
    """{id(tensor): _Read} for every tensor of the (parallelized, meta) model
    that the checkpoint holds, each tensor once (a tied tensor under all its names)."""
    specs = {name: spec for name, _, spec in named_parameter_shards(model)}
    tensors = named_tensors(model)
    names_of: Dict[int, List[str]] = {}
    for name in model.state_dict(keep_vars=True):
        names_of.setdefault(id(tensors[name]), []).append(name)
    plan = {}
    for ident, names in names_of.items():
        source = next((n for n in names if n in keys), None)
        if source is None:
            continue
        entry = entries[keys[source]]
        spec = specs.get(source)
        dim = pieces = None
        if spec is not None:
            size, rank = state.get_group_size(spec.group), state.get_group_rank(spec.group)
            dim, pieces = spec.dim, spec.pieces(entry.shape[spec.dim], size, rank)
        plan[ident] = _Read(entry, dim, pieces, names)
    return plan


def _read_slices(model: nn.Module, reads: Dict[int, _Read], mapped: Dict[int, bool]) -> set:
    """Reads every planned tensor not mapped (``mapped``: ids of the meta
    tensors they replaced) into ``model``; returns the names filled (mapped
    ones included)."""
    tensors = named_tensors(model)
    loaded = set()
    descriptors: Dict[str, int] = {}
    try:
        for ident, read in reads.items():
            loaded.update(read.names)
            if ident in mapped:
                continue
            tensor = tensors[read.names[0]]
            with torch.no_grad():
                target = tensor if tensor.is_contiguous() else torch.empty_like(
                    tensor, memory_format=torch.contiguous_format)
                if isinstance(read.entry, Merged):
                    read_merged(read.entry, target, read.dim, read.pieces, descriptors)
                else:
                    path = read.entry.path
                    if path not in descriptors:
                        descriptors[path] = os.open(path, os.O_RDONLY)
                    read_pieces(read.entry, target, read.dim, read.pieces, fd=descriptors[path])
                if target is not tensor:
                    tensor.copy_(target)
    finally:
        for fd in descriptors.values():
            os.close(fd)
    return loaded


def _finish(model: nn.Module, folder: str) -> None:
    """What transformers' from_pretrained also does: eval mode, the generation config."""
    model.eval()
    if hasattr(model, "generation_config") and os.path.isfile(os.path.join(folder, "generation_config.json")):
        from transformers import GenerationConfig
        try:
            model.generation_config = GenerationConfig.from_pretrained(folder)
        except (OSError, ValueError) as error:
            warnings.warn(f"from_pretrained: {folder!r}'s generation_config.json is not used: {error}")
