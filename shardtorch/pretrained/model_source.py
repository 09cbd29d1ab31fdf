"""What to build for ``from_pretrained`` / ``from_config``: a Hugging Face
class and its config, a timm architecture, or any factory of an nn.Module,
and the dtype to build it in (as transformers resolves ``dtype=``)."""
import contextlib
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch
from torch import nn


@dataclass
class ModelSource:
    """``build()`` makes the unsharded model (under the dtype context); ``config`` is its Hugging Face config or None."""
    build: Callable[[], nn.Module]
    config: Any
    description: str


def is_hf_class(value) -> bool:
    """A transformers PreTrainedModel subclass."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(value, type) and issubclass(value, PreTrainedModel)


def read_config_json(folder: str) -> Optional[Dict[str, Any]]:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def source_from_folder(folder: str, model, config, config_overrides: Dict[str, Any], who: str) -> ModelSource:
    """The model a checkpoint folder describes (``model``: a path, a transformers
    class, or a factory returning the model)."""
    if callable(model) and not isinstance(model, (str, os.PathLike)) and not is_hf_class(model):
        if config is not None or config_overrides:
            raise ValueError(f"{who}: config and config overrides apply to transformers classes, not to a model "
                             f"factory ({model!r}): build the model as you want it in the factory")
        return ModelSource(model, None, getattr(model, "__name__", repr(model)))
    raw = read_config_json(folder)
    if config is None and raw is None:
        raise FileNotFoundError(f"{who}: {folder!r} has no config.json to build the model from; pass config= or a "
                                f"factory returning the model")
    if config is None and "model_type" not in raw and "architecture" in raw:
        return _timm_source(raw, config_overrides, who, folder)
    from transformers import AutoConfig
    if config is None:
        config = AutoConfig.from_pretrained(folder, **config_overrides)
    elif config_overrides:
        for key, value in config_overrides.items():
            setattr(config, key, value)
    cls = model if is_hf_class(model) else _class_from_config(config, folder, who)
    expected = getattr(getattr(cls, "config_class", None), "model_type", None)
    if expected and getattr(config, "model_type", None) not in (expected, None) and not isinstance(
            config, cls.config_class):
        raise ValueError(f"{who}: the checkpoint in {folder!r} is a {config.model_type!r} model "
                         f"({type(config).__name__}), not the {expected!r} that {cls.__name__} builds")
    return ModelSource(lambda: cls(config), config, cls.__name__)


def source_from_config(model, config, who: str) -> ModelSource:
    if is_hf_class(model):
        if config is None:
            raise ValueError(f"{who}: {model.__name__} needs its config (config=...)")
        return ModelSource(lambda: model(config), config, model.__name__)
    if not callable(model):
        raise TypeError(f"{who}: model must be a transformers class or a factory returning a torch.nn.Module, got "
                        f"{type(model).__name__}")
    if config is not None:
        return ModelSource(lambda: model(config), config, getattr(model, "__name__", repr(model)))
    return ModelSource(model, None, getattr(model, "__name__", repr(model)))


def _class_from_config(config, folder: str, who: str):
    import transformers
    names = list(getattr(config, "architectures", None) or [])
    for name in names:
        cls = getattr(transformers, name, None)
        if is_hf_class(cls):
            return cls
    raise ValueError(f"{who}: {folder!r}'s config.json names no transformers class (architectures: {names}); pass "
                     f"the class: from_pretrained(LlamaForCausalLM, {folder!r})")


def _timm_source(raw: Dict[str, Any], overrides: Dict[str, Any], who: str, folder: str) -> ModelSource:
    try:
        import timm
    except ImportError as error:
        raise ImportError(f"{who}: {folder!r} holds a timm model ({raw['architecture']!r}); install timm") from error
    kwargs = dict(raw.get("model_args") or {})
    for key in ("num_classes", "global_pool"):
        if key in raw:
            kwargs.setdefault(key, raw[key])
    kwargs.update(overrides)
    name = raw["architecture"]
    return ModelSource(lambda: timm.create_model(name, pretrained=False, **kwargs), None, f"timm {name}")


def resolve_dtype(dtype, config, checkpoint_dtypes, who: str) -> torch.dtype:
    """``dtype`` as transformers takes it: a torch.dtype, its name, or "auto"
    (the config's ``dtype``, else the checkpoint's first floating dtype)."""
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        resolved = None
        if config is not None:
            value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
            resolved = getattr(torch, value) if isinstance(value, str) else value
        if resolved is None:
            resolved = next((d for d in checkpoint_dtypes if d.is_floating_point), torch.get_default_dtype())
    elif isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        resolved = getattr(torch, dtype)
    elif dtype is None:
        resolved = torch.get_default_dtype()
    else:
        raise ValueError(f"{who}: dtype must be a torch.dtype, its name or 'auto', got {dtype!r}")
    if not resolved.is_floating_point:
        raise ValueError(f"{who}: dtype must be a floating-point dtype, got {resolved}")
    if config is not None and hasattr(config, "dtype"):
        config.dtype = resolved
    return resolved


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Builds in ``dtype`` as transformers does (torch's default dtype for the
    construction): buffers the model computes in float32 explicitly stay so."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)
