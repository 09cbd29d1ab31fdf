"""The methods of a parallelized Hugging Face model that differ from its class's.

- ``save_pretrained`` and ``push_to_hub`` write the unsharded model's
  checkpoint: transformers' own would write this rank's shards as if they
  were whole tensors (a checkpoint nothing can load); these go through
  ``shardtorch.pretrained.save``.
- ``generate`` first checks, once, that every rank of the tensor-parallel
  group was given the same prompts, the same settings and (when it samples)
  the same random state: each rank computes the whole logits and picks its
  own next token, so ranks given different inputs would go on with different
  sequences (and different cache lengths) in silence. Then it is
  transformers' own ``generate``, on whole logits also when the model was
  parallelized with ``logits="sharded"`` (generate picks tokens from them).

``parallelize`` gives the model a subclass of its class (as FSDP2's
``fully_shard`` does) with these methods, named after the class
(``ParallelLlamaForCausalLM``) and registered in this module, so that
pickling the model still finds it.
"""
import hashlib
import os
import sys
import tempfile
from typing import Dict

import torch
from torch import nn

from ...distributed import collectives
from ...pretrained.save import save_pretrained as _save_unsharded
from ...checkpoint.verify import agree_on_problems

_CLASSES: Dict[type, type] = {}


def _save_pretrained(self, save_directory, is_main_process: bool = True, state_dict=None, push_to_hub: bool = False,
                     max_shard_size="50GB", safe_serialization: bool = True, **kwargs):
    """Writes the unsharded model's checkpoint (shardtorch.pretrained.save):
    call it on every rank (``is_main_process`` is ignored: rank 0 writes)."""
    if push_to_hub:
        return self.push_to_hub(kwargs.pop("repo_id", os.path.basename(os.fspath(save_directory))),
                                max_shard_size=max_shard_size, **kwargs)
    _save_unsharded(self, save_directory, max_shard_size=max_shard_size, state_dict=state_dict,
                    safe_serialization=safe_serialization)


def _push_to_hub(self, repo_id: str, commit_message=None, private=None, token=None, max_shard_size="5GB",
                 create_pr: bool = False, revision=None, **kwargs):
    """Saves the unsharded checkpoint to a temporary folder (every rank), then
    rank 0 uploads it; every rank raises if the upload fails."""
    from ...distributed import state
    with tempfile.TemporaryDirectory() as folder:
        _save_unsharded(self, folder, max_shard_size=max_shard_size)
        problem, result = None, None
        if state.get_rank() == 0:
            try:
                from huggingface_hub import HfApi
                api = HfApi(token=token)
                repo = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
                result = api.upload_folder(repo_id=repo, folder_path=folder, commit_message=commit_message or
                                           "Upload model", create_pr=create_pr, revision=revision)
            except Exception as error:  # noqa: BLE001 - reported on every rank
                problem = f"{type(error).__name__}: {error}"
        agree_on_problems(problem, "push_to_hub: ")
    return result


def _digest(value) -> str:
    """A stable fingerprint of a generate argument (tensors by their bytes)."""
    if isinstance(value, torch.Tensor):
        data = value.detach().to("cpu").contiguous()
        raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
        return f"tensor{tuple(data.shape)}{data.dtype}:" + hashlib.sha256(raw).hexdigest()
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_digest(v)}" for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_digest(v) for v in value) + "]"
    if hasattr(value, "to_diff_dict"):  # a GenerationConfig
        return _digest(value.to_diff_dict())
    return repr(value) if isinstance(value, (int, float, str, bool, type(None))) else type(value).__name__


def _check_same_generation(model, args, kwargs) -> None:
    from ...distributed import state
    group = model.__dict__.get(_GROUP, state.TENSOR_PARALLEL)
    if state.get_group_size(group) == 1:
        return
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    sampling = bool(kwargs.get("do_sample", getattr(config, "do_sample", False)))
    mine = {"prompts and tensors": _digest([args, {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}]),
            "settings": _digest([{k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)
                                  and k not in ("streamer", "stopping_criteria", "logits_processor", "assistant_model")},
                                 getattr(model, "generation_config", None)]),
            "random state (sampling)": _digest(torch.get_rng_state()) if sampling else ""}
    everyone = [None] * state.get_group_size(group)
    collectives.all_gather_object(everyone, mine, group=state.get_group(group))
    differ = [what for what in mine if len({str(rank[what]) for rank in everyone}) > 1]
    if differ:
        raise ValueError(
            f"generate: the ranks of tensor-parallel group {group!r} were given different "
            f"{' and '.join(differ)}; every rank of a group computes the same sequences, so give them the same "
            f"prompts and settings" + (" and seed them alike (torch.manual_seed) before sampling"
                                       if "random state (sampling)" in differ else ""))


def _generate(self, *args, **kwargs):
    """transformers' generate, after checking that every rank of the group was given the same prompts,
    settings and (sampling) random state, on whole logits in either logits mode."""
    _check_same_generation(self, args, kwargs)
    from .logits import generating
    with generating(self):  # whole logits to pick tokens from, also under logits="sharded"
        return type(self)._shardtorch_parallel_of.generate(self, *args, **kwargs)


_GROUP = "_shardtorch_tensor_parallel_group"


def parallel_class(cls: type) -> type:
    """The subclass of ``cls`` whose save_pretrained / push_to_hub write the unsharded checkpoint."""
    if getattr(cls, "_shardtorch_parallel_of", None) is not None:
        return cls
    if cls not in _CLASSES:
        name = f"Parallel{cls.__name__}"
        methods = {"save_pretrained": _save_pretrained, "push_to_hub": _push_to_hub,
                   "_shardtorch_parallel_of": cls, "__module__": __name__}
        if callable(getattr(cls, "generate", None)):
            methods["generate"] = _generate
        subclass = type(name, (cls,), methods)
        subclass.__qualname__ = name
        setattr(sys.modules[__name__], name, subclass)
        _CLASSES[cls] = subclass
    return _CLASSES[cls]


def parallel_hf_methods(model: nn.Module, group: str) -> bool:
    """Gives a Hugging Face model (one with ``save_pretrained``) the methods
    above; returns whether it did."""
    if not callable(getattr(model, "save_pretrained", None)):
        return False
    model.__class__ = parallel_class(type(model))
    model.__dict__[_GROUP] = group
    return True
