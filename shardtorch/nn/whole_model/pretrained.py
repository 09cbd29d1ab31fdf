"""Parallelized models that no rank ever holds whole: ``ts.nn.from_pretrained``
(each rank reads its slices of a Hugging Face checkpoint) and
``ts.nn.from_config`` (each rank draws its slices of a fresh model's own
initialisation).

Each is the sequence of steps of shardtorch/pretrained/load_steps.py, with
``parallelize`` between the build on the meta device and the materialisation:
the steps live beside ``save_pretrained`` in shardtorch/pretrained/, these two
here because they call ``parallelize`` (shardtorch/pretrained/ sits below this
package: a parallelized model's ``save_pretrained`` reaches into it).
"""
import os

from torch import nn

from ...distributed import state
from ...pretrained.agreement import agreed
from ...pretrained.load_steps import (Load, MetaModel, build_on_meta, build_on_meta_drawing, draw_slices, finish,
                                      initialise_missing, match_keys, materialise, plan_reads, read_slices,
                                      read_source, warn_unused)
from ...pretrained.model_source import resolve_dtype, source_from_config
from .apply import parallelize
from .options_agree import check_options_agree, options_checked


def from_pretrained(model, path=None, *, dtype="auto", plan="auto", group: str = state.TENSOR_PARALLEL,
                    sequence_parallel: bool = False, verbose: bool = False, logits: str = "lazy", device="cpu",
                    mmap: bool = True, config=None, verify: bool = True, devices=None, **config_overrides) -> nn.Module:
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
        devices: from one process, without torchrun (a notebook): a list of
            devices (``["cuda:0", "cuda:1"]``, ``["cpu", "cpu"]``), one rank
            each, started by this call; each loads only its slices, and the
            result is a ``ts.TensorParallelModel`` used as the unsharded model
            (``ts.tensor_parallel``). ``group`` and ``device`` do not apply.

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
    if devices is not None:
        if group != state.TENSOR_PARALLEL or device != "cpu":
            raise TypeError("from_pretrained: group= and device= do not go with devices=: the ranks form one group "
                            "and each rank's device is its entry of devices")
        from ...one_process.api import from_pretrained_on
        return from_pretrained_on(devices, (model, path), dict(
            dtype=dtype, plan=plan, sequence_parallel=sequence_parallel, verbose=verbose, logits=logits, mmap=mmap,
            config=config, verify=verify, **config_overrides))
    folder = _checkpoint_folder(model, path)
    check_options_agree(who, group, {"dtype": dtype, "plan": plan, "sequence_parallel": sequence_parallel,
                                     "verbose": verbose, "logits": logits, "verify": verify,
                                     "config_overrides": config_overrides})

    # One verdict for the first three steps: nothing is split or read unless every rank can go on.
    def read_build_and_match() -> Load:
        source = read_source(folder, model, config, config_overrides, dtype, who)
        meta = build_on_meta(source)
        return Load(source, meta, match_keys(meta, source, who))

    load = agreed(read_build_and_match, who)
    built = load.meta.model
    _split(built, plan, group, sequence_parallel, verbose, logits, verify)
    reads = plan_reads(load)
    materialised = agreed(lambda: materialise(built, reads, device, mmap), who)
    loaded = agreed(lambda: read_slices(built, reads, materialised), who)
    initialise_missing(load, materialised, loaded, who)
    warn_unused(load, who)
    finish(built, folder)
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
    meta: MetaModel = agreed(lambda: build_on_meta_drawing(source.build, resolved), who)
    _split(meta.model, plan, group, sequence_parallel, verbose, logits, verify)
    draw_slices(meta, who)
    return meta.model.to(device)


def _checkpoint_folder(model, path) -> str:
    if path is None:
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"from_pretrained: give the checkpoint folder: from_pretrained(path) or "
                            f"from_pretrained(ModelClass, path), got model={model!r} and no path")
        path = model
    return os.fspath(path)


def _split(model: nn.Module, plan, group: str, sequence_parallel: bool, verbose: bool, logits: str,
           verify: bool) -> None:
    """``parallelize`` on the meta model, after the agreement: its refusals are the same on every rank (they
    read only the model), and verbose=True makes a collective. The options were checked by the caller."""
    with options_checked(group):
        parallelize(model, plan=plan, group=group, sequence_parallel=sequence_parallel, verbose=verbose,
                    logits=logits, verify=verify)
