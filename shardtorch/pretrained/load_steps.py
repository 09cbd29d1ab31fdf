"""The steps of ``ts.nn.from_pretrained`` and ``ts.nn.from_config``, in the order they run, each
taking and returning explicit values (nn/whole_model/pretrained.py runs them, with ``parallelize``
between the build and the materialisation):

    read_source -> build_on_meta -> match_keys        (one verdict for the three: agreed)
    -> parallelize -> plan_reads -> materialise -> read_slices -> initialise_missing -> warn_unused
    -> finish

and for a fresh model: build_on_meta_drawing -> parallelize -> draw_slices.
"""
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Set

import torch
from torch import nn

from .agreement import agreed_generator
from .checkpoint_files import checkpoint_entries
from .checkpoint_keys import converted_entries
from .init_record import InitRecord
from .init_replay import replay, targets_of
from .key_match import all_found, check_shapes, matching_keys
from .materialize import materialize, named_tensors
from .meta_build import MetaBuildError, build_recorded, build_recorded_partly
from .model_source import ModelSource, default_dtype, resolve_dtype, source_from_folder
from .safetensors_format import TensorEntry
from .safetensors_read import map_run
from .slice_reads import SliceRead, read_planned, slice_reads_of


@dataclass
class Source:
    """read_source: the checkpoint folder, its tensors (headers only), the model to build and its dtype."""
    folder: str
    entries: Dict[str, TensorEntry]
    model: ModelSource
    dtype: torch.dtype


@dataclass
class MetaModel:
    """build_on_meta: the model with its sized tensors on the meta device, what its own init wrote into
    them (``record``; ``complete`` False where an init that reads values could not be recorded), and
    those whole meta tensors by name (``originals``), which the split later replaces by shards."""
    model: nn.Module
    record: InitRecord
    complete: bool
    originals: Dict[str, torch.Tensor]


@dataclass
class KeyMatch:
    """match_keys: the checkpoint's tensors under the model's names where transformers converts them
    (``entries``), {model key: checkpoint key}, the model's keys the checkpoint lacks and the
    checkpoint's keys the model does not use."""
    entries: Dict[str, Any]
    keys: Dict[str, str]
    missing: List[str]
    unexpected: List[str]


@dataclass
class Load:
    """What the agreed first steps of from_pretrained found, before anything is split or read."""
    source: Source
    meta: MetaModel
    match: KeyMatch


@dataclass
class Materialised:
    """materialise: the names whose tensors were on the meta device (now real), and the ids of the
    meta tensors replaced by a map of the file (read_slices skips them)."""
    meta_names: Set[str]
    mapped: Set[int]


def read_source(folder: str, model, config, config_overrides: Dict[str, Any], dtype, who: str) -> Source:
    entries = checkpoint_entries(folder)
    source = source_from_folder(folder, model, config, config_overrides, who)
    resolved = resolve_dtype(dtype, source.config, [e.dtype for e in entries.values()], who)
    return Source(folder, entries, source, resolved)


def build_on_meta(source: Source) -> MetaModel:
    """The model to be loaded, its draws not consumed (the checkpoint replaces them)."""
    with default_dtype(source.dtype):
        complete = True
        try:
            built, record = build_recorded(source.model.build, consume_random=False)
        except MetaBuildError:
            # An initialisation that needs real values: the checkpoint replaces them; the record then lacks
            # what such initialisers write (weights the checkpoint lacks cannot be drawn).
            (built, record), complete = build_recorded_partly(source.model.build), False
    return MetaModel(built, record, complete, named_tensors(built))


def match_keys(meta: MetaModel, source: Source, who: str) -> KeyMatch:
    """Raises on a checkpoint of another architecture or a shape that disagrees with the config."""
    entries = source.entries
    if not all_found(meta.model, entries):  # a checkpoint in the model's original format
        entries = converted_entries(meta.model, entries, who)  # transformers' renamings and merges of the keys
    keys = matching_keys(meta.model, entries, source.model.description, source.folder)
    missing, unexpected = check_shapes(meta.model, meta.originals, entries, keys, source.folder)
    return KeyMatch(entries, keys, missing, unexpected)


def plan_reads(load: Load) -> Dict[int, SliceRead]:
    """Each tensor's slices of the checkpoint, from the split (parallelized) model."""
    return slice_reads_of(load.meta.model, load.match.keys, load.match.entries)


def materialise(model: nn.Module, reads: Dict[int, SliceRead], device, mmap: bool) -> Materialised:
    """Gives every meta tensor real memory of its shard's shape: a copy-on-write map of the file where
    ``mmap`` and the slice is one run of the file in its own dtype (a CPU parameter), else empty."""
    mapped: Set[int] = set()

    def provide(meta_tensor):
        read = reads.get(id(meta_tensor))
        if not mmap or read is None or not isinstance(meta_tensor, nn.Parameter) or torch.device(device).type != "cpu":
            return None
        run = read.run(meta_tensor)
        if run is None:
            return None
        mapped.add(id(meta_tensor))
        return map_run(read.entry, tuple(meta_tensor.shape), run)

    meta_names = set(materialize(model, device, provide))
    return Materialised(meta_names, mapped)


def read_slices(model: nn.Module, reads: Dict[int, SliceRead], materialised: Materialised) -> Set[str]:
    """The names filled from the checkpoint (mapped ones included)."""
    return read_planned(model, reads, materialised.mapped)


def initialise_missing(load: Load, materialised: Materialised, loaded: Set[str], who: str) -> None:
    """Initialises what the checkpoint lacks (and the non-persistent meta buffers) by the model's own
    init, drawn from a generator seeded alike on every rank (a collective), and names what was missing."""
    model, meta = load.meta.model, materialised.meta_names
    persistent = list(model.state_dict(keep_vars=True).keys())
    to_initialise = [name for name in persistent if name not in loaded and name in meta]
    # In the model's order, not the set's: the draws from the shared generator must come in one order on
    # every rank (a set of strings iterates in each process's own hash order).
    computed = [name for name, _ in model.named_buffers(remove_duplicate=False)
                if name in meta and name not in persistent and name not in loaded]
    computed += sorted(name for name in meta if name not in persistent and name not in loaded and name not in computed)
    generator = agreed_generator()
    if not load.meta.complete and to_initialise:
        raise MetaBuildError(f"{who}: {', '.join(to_initialise)} are not in {load.source.folder!r}, and the model's "
                             f"own initialisation cannot run on the meta device to draw them (it reads tensor values)")
    replay(load.meta.record, targets_of(model, load.meta.originals, to_initialise + computed), live=True,
           generator=generator, who=who)
    missing = load.match.missing
    if missing:
        warnings.warn(f"{who}: {len(missing)} weight(s) of {type(model).__name__} are not in {load.source.folder!r} "
                      f"and are initialised by the model's own init: {', '.join(missing)}")


def warn_unused(load: Load, who: str) -> None:
    unexpected = load.match.unexpected
    if unexpected:
        warnings.warn(f"{who}: {len(unexpected)} tensor(s) of {load.source.folder!r} are not used by "
                      f"{type(load.meta.model).__name__}: {', '.join(unexpected)}")


def finish(model: nn.Module, folder: str) -> None:
    """What transformers' from_pretrained also does: eval mode, the generation config."""
    model.eval()
    if hasattr(model, "generation_config") and os.path.isfile(os.path.join(folder, "generation_config.json")):
        from transformers import GenerationConfig
        try:
            model.generation_config = GenerationConfig.from_pretrained(folder)
        except (OSError, ValueError) as error:
            warnings.warn(f"from_pretrained: {folder!r}'s generation_config.json is not used: {error}")


def build_on_meta_drawing(build: Callable[[], nn.Module], dtype: torch.dtype) -> MetaModel:
    """A fresh model (from_config): every draw into a meta tensor advances the generator as the whole
    tensor's draw would, so that the record's generator states are the unsharded model's."""
    with default_dtype(dtype):
        built, record = build_recorded(build, consume_random=True)
    return MetaModel(built, record, True, named_tensors(built))


def draw_slices(meta: MetaModel, who: str) -> None:
    """Gives the split model's meta tensors CPU memory and replays into them the draws recorded."""
    meta_names = materialize(meta.model, "cpu")
    replay(meta.record, targets_of(meta.model, meta.originals, meta_names), live=False, who=who)
