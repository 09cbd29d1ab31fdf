"""Which checkpoint tensor fills which weight of the model, as transformers matches them: the same
key, or with the base model's prefix added or removed; tied weights under any of their names; shapes
checked against the config; what is missing and what is left unused."""
import re
from typing import Dict, List, Tuple

from torch import nn

from .materialize import named_tensors


def all_found(model: nn.Module, entries) -> bool:
    """Whether every model key is in the checkpoint as it is (or under another name of its tensor)."""
    tied = tied_names(model)
    return all(key in entries or any(other in entries for other in tied.get(key, ()))
               for key in model.state_dict(keep_vars=True))


def matching_keys(model: nn.Module, entries, description: str, folder: str) -> Dict[str, str]:
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
    patterns = list(getattr(model, attribute, None) or [])
    patterns += [r"rotary_emb\.inv_freq", r"(^|\.)position_ids$"] if attribute.endswith("unexpected") else []
    return any(re.search(pattern, key) for pattern in patterns)


def check_shapes(model, originals, entries, keys, folder) -> Tuple[List[str], List[str]]:
    """(missing keys, unexpected keys); raises on a shape that disagrees."""
    problems = []
    for name, key in keys.items():
        expected, found = tuple(originals[name].shape), entries[key].shape
        if expected != found:
            problems.append(f"{key!r} has shape {list(found)} in the checkpoint, the model's config gives "
                            f"{list(expected)}")
    if problems:
        raise ValueError(f"from_pretrained: {folder!r} does not fit {type(model).__name__}: " + "; ".join(problems))
    tied = tied_names(model)
    missing = [name for name in model.state_dict(keep_vars=True) if name not in keys
               and not any(other in keys for other in tied.get(name, ()))
               and not _ignored(model, "_keys_to_ignore_on_load_missing", name)]
    used = set(keys.values())
    unexpected = [key for key in entries if key not in used
                  and not _ignored(model, "_keys_to_ignore_on_load_unexpected", key)]
    return missing, unexpected


def tied_names(model: nn.Module) -> Dict[str, List[str]]:
    """{name: other names of the same tensor}."""
    by_tensor: Dict[int, List[str]] = {}
    for name, tensor in named_tensors(model).items():
        by_tensor.setdefault(id(tensor), []).append(name)
    return {name: [n for n in names if n != name] for names in by_tensor.values() for name in names}
