"""The proof for a model that is never whole on a rank (``from_pretrained``, ``from_config``, a model
built on the meta device): it runs on a miniature of the same class instead.

The miniature is the model's own class built from a copy of its config with the sizes shrunk (at
most a few layers, heads of width 16, a small MLP and vocabulary) and everything the split reads
kept: the head counts (query and key/value), the number of experts, and every size's remainder over
the group (a vocabulary that does not divide by the ranks stays so). Every rank builds it whole
under one seed, ``parallelize`` splits it by the same plan and proves it (proof.py); the model is
split only if that proof holds. The kinds of split must match: every split the model gets (by
module name with layer numbers dropped, style and layout) is one the miniature got and proved,
else a warning names what stayed unproven.

What this proves: the class's code (its forward, attention, MLPs, what it does with the logits)
under these split rules. What it cannot: a change made to one instance after it was built (a
module swapped, a forward patched), code that only runs at the full sizes or in layers past the
miniature's, and the checkpoint's values.
"""
import contextlib
import copy
import re
import warnings
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ...distributed import state
from . import proof
from ...pretrained.model_source import default_dtype
from .plan import Placement, resolve

_HEAD_WIDTH = 16  # even, so rotary embeddings (whole or partial) still pair dimensions
_MLP, _VOCABULARY = 32, 128  # the least sizes; each keeps its remainder over the group
_MAX_LAYERS = 2
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "encoder_layers", "decoder_layers",
           "n_layers")
_WIDTHS = ("hidden_size", "n_embd", "d_model", "dim", "embed_dim")
_HEAD_WIDTHS = ("head_dim", "d_kv", "kv_channels")
_HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads")
_MLPS = ("intermediate_size", "n_inner", "ffn_dim", "d_ff", "moe_intermediate_size", "shared_expert_intermediate_size",
         "decoder_ffn_dim", "encoder_ffn_dim", "hidden_dim")
_VOCABULARIES = ("vocab_size", "n_vocab")
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
              "cls_token_id", "mask_token_id", "unk_token_id")


def _keeping_remainder(size: int, least: int, ranks: int) -> int:
    """The least value >= ``least`` with ``size``'s remainder over ``ranks``."""
    value = least + (size - least) % ranks
    return value if value >= least else value + ranks


def _own(config) -> Dict[str, object]:
    return {k: v for k, v in vars(config).items() if not k.startswith("_")}


def miniature_config(config, ranks: int):
    """A shrunk copy of a Hugging Face ``config`` (module docstring), or None when it has no sizes to
    shrink (not a transformers config)."""
    try:
        from transformers import PretrainedConfig
    except ImportError:
        return None
    if not isinstance(config, PretrainedConfig):
        return None
    mini = copy.deepcopy(config)
    own = _own(mini)
    layers = next((own[k] for k in _LAYERS if isinstance(own.get(k), int)), None)
    kept = _layers_kept(own, layers)
    for key, value in own.items():
        if key in _LAYERS and isinstance(value, int):
            setattr(mini, key, min(value, kept))
        elif layers and isinstance(value, (list, tuple)) and len(value) == layers and key not in _TOKEN_IDS:
            setattr(mini, key, type(value)(value[:kept]))  # one entry per layer (layer_types)
    heads = next((own[k] for k in _HEADS if isinstance(own.get(k), int) and own[k] > 0), 4)
    for key in _HEAD_WIDTHS:
        if isinstance(own.get(key), int):
            setattr(mini, key, _HEAD_WIDTH)
    for key in _WIDTHS:
        if isinstance(own.get(key), int):
            setattr(mini, key, heads * _HEAD_WIDTH)
    for key in _MLPS:
        if isinstance(own.get(key), int) and own[key] > 0:
            setattr(mini, key, _keeping_remainder(own[key], _MLP, ranks))
    for key in _VOCABULARIES:
        if isinstance(own.get(key), int) and own[key] > 0:
            vocabulary = _keeping_remainder(own[key], _VOCABULARY, ranks)
            setattr(mini, key, vocabulary)
            _renumber_token_ids(mini, own, vocabulary)
    return mini


def _layers_kept(own: Dict[str, object], layers: Optional[int]) -> int:
    """At most _MAX_LAYERS, or up to the first layer of each kind that ``layer_types`` names."""
    if not layers:
        return _MAX_LAYERS
    kinds = own.get("layer_types")
    kept = _MAX_LAYERS
    if isinstance(kinds, (list, tuple)) and len(kinds) == layers:
        kept = max([kept] + [list(kinds).index(kind) + 1 for kind in set(kinds)])
    return min(layers, kept)


def _renumber_token_ids(mini, own: Dict[str, object], vocabulary: int) -> None:
    """Token ids past the miniature's vocabulary move to its last ids, equal ids staying equal."""
    large = sorted({i for k in _TOKEN_IDS for i in _ids(own.get(k)) if i >= vocabulary})
    moved = {old: vocabulary - 1 - n for n, old in enumerate(large)}
    for key in _TOKEN_IDS:
        value = own.get(key)
        if isinstance(value, int):
            setattr(mini, key, moved.get(value, value))
        elif isinstance(value, (list, tuple)):
            setattr(mini, key, type(value)(moved.get(i, i) for i in value))


def _ids(value) -> List[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)):
        return [i for i in value if isinstance(i, int)]
    return []


def _kinds(placements: List[Placement]) -> Set[Tuple[str, str, str]]:
    """(module name with its numbers as '#', style, layout) of every split."""
    kinds = set()
    for p in placements:
        if p.style == "replicate":
            continue
        variant = "" if p.fit is None else f"{type(p.layout).__name__}/{p.fit.variant}"
        kinds.add((re.sub(r"\.\d+(?=\.|$)", ".#", p.name), p.style, variant))
    return kinds


def _mini_plan(plan, mini: nn.Module):
    if not isinstance(plan, dict):
        return plan
    names = dict(mini.named_modules())
    return {name: style for name, style in plan.items() if name in names}


def _device(group: str) -> torch.device:
    """Where the miniature runs: where the group's collectives run."""
    if dist.get_backend(state.get_group(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def _built_alike():
    """The same weights on every rank, and the caller's random state untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        yield


def prove_on_miniature(model: nn.Module, placements: List[Placement], plan, group: str, sequence_parallel: bool,
                       logits: str, parallelize: Callable[..., nn.Module]) -> bool:
    """Proves ``model``'s split on a miniature of its class (module docstring); raises
    ParallelizeProofError on every rank if that split is not exact, warns where it cannot prove. Returns
    whether a miniature's split was proven (its warnings may still name splits it does not cover)."""
    size = state.get_group_size(group)
    name = type(model).__name__
    config = miniature_config(getattr(model, "config", None), size)
    if config is None:
        _warn(f"{name} is on the meta device and has no Hugging Face config to build a miniature of it from")
        return False
    dtype = proof.bound_for(model)[0]
    try:
        with _built_alike(), default_dtype(torch.float64 if dtype == torch.float64 else torch.float32):
            mini = type(model)(config)
        mini = mini.to(_device(group)).eval()
        mini_plan = _mini_plan(plan, mini)
        unmatched = _kinds(placements) - _kinds(resolve(mini, mini_plan, size, sequence_parallel))
    except Exception as error:  # noqa: BLE001 - a class that cannot be built small: said, not hidden
        unmatched, mini = None, f"{type(error).__name__}: {error}"
    if proof.agree_on_error(float(isinstance(mini, str)), group) > 0:  # so that every rank warns, none proves
        why = mini if isinstance(mini, str) else "it failed on another rank"
        _warn(f"a miniature of {name} (to prove the split of a model on the meta device) cannot be built ({why})")
        return False
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            parallelize(mini, plan=mini_plan, group=group, sequence_parallel=sequence_parallel, logits=logits,
                        verify=True)
        except proof.ParallelizeProofError as error:
            raise proof.ParallelizeProofError(
                f"{_described(config, name)}: " + proof.explain(error.failures, placements, error.dtype, error.bound,
                                                               sequence_parallel, split=False),
                error.failures, error.dtype, error.bound) from None
    for warning in said:
        if "not proven" in str(warning.message):
            _warn(f"on a miniature of {name}: {warning.message}")
    if unmatched:
        _warn(f"{name}'s splits {sorted(unmatched)} do not occur in its miniature "
              f"({_described(config, name)}), so they are not proven")
    return not any("not proven" in str(w.message) for w in said)


def _described(config, name: str) -> str:
    own = _own(config)
    sizes = ", ".join(f"{k}={own[k]}" for k in _LAYERS + _WIDTHS + _HEADS + _MLPS[:1] + _VOCABULARIES
                      if isinstance(own.get(k), int))
    return f"proven on a miniature of {name} ({sizes})"


def _warn(why: str) -> None:
    warnings.warn(f"parallelize: {why}; the split is not proven exact against the whole model "
                  f"(docs/pretrained.md: the proof)", stacklevel=3)
