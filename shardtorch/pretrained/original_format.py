"""The names and tensors that transformers' own ``save_pretrained`` writes.

transformers 5 holds some models in another form than their checkpoints and
converts them when loading (``transformers.conversion_mapping``): Mixtral's
per-expert ``block_sparse_moe.experts.N.w1`` / ``w3`` / ``w2`` become the fused
``mlp.experts.gate_up_proj`` / ``down_proj``, Qwen2-MoE's (and the MoE models
that share its mapping) ``experts.N.gate_proj`` / ``up_proj`` / ``down_proj``
likewise, GPT-NeoX's ``embed_out`` is the model's ``lm_head``. Its save reverts
the conversion (``transformers.core_model_loading.revert_weight_conversion``),
so files keep the checkpoint's original names. The save of a parallelized
model asks that same function, for one whole tensor at a time: on meta tensors
of the full shapes to plan the files' headers, then on each gathered tensor for
its values. Where the reversion of one tensor is not that tensor's part of the
whole model's reversion (a conversion that would combine several of the
model's tensors into one file tensor), the model's own names are kept, with a
warning: transformers and ``ts.nn.from_pretrained`` load those too.
"""
import contextlib
import warnings
from typing import Dict, List, Tuple

import torch
from torch import nn

Entry = Tuple[str, torch.dtype, Tuple[int, ...]]


def unsharded_class(model: nn.Module) -> type:
    """The model's own class, under shardtorch's and FSDP2's subclasses."""
    cls = type(model)
    while getattr(cls, "_shardtorch_parallel_of", None) is not None or cls.__name__.startswith("FSDP"):
        cls = getattr(cls, "_shardtorch_parallel_of", None) or cls.__mro__[1]
    return cls


def saved_entries(model: nn.Module, entries: List[Entry]) -> Dict[str, List[Entry]]:
    """{model key: [(file key, dtype, full shape)]}: what transformers' save writes for each of ``entries``
    (the model's tensors, tied ones once, with their full shapes)."""
    unchanged = {name: [(name, dtype, shape)] for name, dtype, shape in entries}
    if not _has_conversions(model):
        return unchanged
    meta = {name: torch.empty(shape, dtype=dtype, device="meta") for name, dtype, shape in entries}
    whole = _as_entries(_reverted(model, dict(meta)))
    if sorted(whole) == sorted(e for entry in unchanged.values() for e in entry):
        return unchanged
    saved: Dict[str, List[Entry]] = {}
    try:
        for name, tensor in meta.items():
            saved[name] = _as_entries(_reverted(model, {name: tensor}))
    except Exception as error:  # transformers' own ops refuse a part of a many-to-one conversion in many ways
        return _keep_names(model, unchanged, f"reverting one tensor alone raised {error!r}")
    parts = [entry for entry in saved.values() for entry in entry]
    if len({key for key, _, _ in parts}) != len(parts) or sorted(parts) != sorted(whole):
        return _keep_names(model, unchanged, "reverting tensor by tensor does not give the whole model's reversion")
    return saved


def saved_tensors(model: nn.Module, name: str, tensor: torch.Tensor, entries: List[Entry]) -> Dict[str, torch.Tensor]:
    """{file key: tensor} of the model's whole tensor ``name``, as ``saved_entries`` planned them."""
    if entries == [(name, tensor.dtype, tuple(tensor.shape))]:
        return {name: tensor}
    pieces = _reverted(model, {name: tensor})
    if _as_entries(pieces) != sorted(entries):
        raise RuntimeError(f"save_pretrained: transformers' conversion of {name!r} gave {_as_entries(pieces)}, "
                           f"where its shapes gave {sorted(entries)}")
    return pieces


def _has_conversions(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion  # noqa: F401 (transformers 5)
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def _reverted(model: nn.Module, state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    from transformers.core_model_loading import revert_weight_conversion
    with _seen_as_unsharded(model):
        return revert_weight_conversion(model, state_dict)


@contextlib.contextmanager
def _seen_as_unsharded(model: nn.Module):
    """transformers finds a model's mapping by its class (the class name, else the config's model_type,
    and none for a class defined outside transformers): the parallel subclass (ParallelMixtralForCausalLM,
    defined by shardtorch) would count as custom code without one. The model is its own class while
    transformers looks."""
    parallel = type(model)
    model.__class__ = unsharded_class(model)
    try:
        yield
    finally:
        model.__class__ = parallel


def _as_entries(tensors: Dict[str, torch.Tensor]) -> List[Entry]:
    return sorted((key, t.dtype, tuple(t.shape)) for key, t in tensors.items())


def _keep_names(model: nn.Module, unchanged: Dict[str, List[Entry]], why: str) -> Dict[str, List[Entry]]:
    warnings.warn(f"save_pretrained: {unsharded_class(model).__name__}'s checkpoint keeps the model's own tensor "
                  f"names, not the original ones transformers' save writes: {why}; transformers and "
                  f"ts.nn.from_pretrained load it alike")
    return unchanged
