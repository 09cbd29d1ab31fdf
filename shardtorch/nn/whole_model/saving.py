"""``model.save_pretrained`` and ``model.push_to_hub`` of a parallelized
Hugging Face model write the unsharded model's checkpoint.

transformers' own methods would write this rank's shards as if they were whole
tensors (a checkpoint nothing can load), so ``parallelize`` gives the model a
subclass of its class (as FSDP2's ``fully_shard`` does) whose two methods go
through ``shardtorch.checkpoint.pretrained_save``. The subclass is named after
the class (``ParallelLlamaForCausalLM``) and registered in this module, so
that pickling the model still finds it.
"""
import os
import sys
import tempfile
from typing import Dict

from torch import nn

from ...checkpoint.pretrained_save import save_pretrained as _save_unsharded
from ...checkpoint.verify import agree_on_problems

_CLASSES: Dict[type, type] = {}


def _save_pretrained(self, save_directory, is_main_process: bool = True, state_dict=None, push_to_hub: bool = False,
                     max_shard_size="50GB", safe_serialization: bool = True, **kwargs):
    """Writes the unsharded model's checkpoint (shardtorch.checkpoint.pretrained_save):
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


def parallel_class(cls: type) -> type:
    """The subclass of ``cls`` whose save_pretrained / push_to_hub write the unsharded checkpoint."""
    if getattr(cls, "_shardtorch_parallel_of", None) is not None:
        return cls
    if cls not in _CLASSES:
        name = f"Parallel{cls.__name__}"
        subclass = type(name, (cls,), {"save_pretrained": _save_pretrained, "push_to_hub": _push_to_hub,
                                       "_shardtorch_parallel_of": cls, "__module__": __name__})
        subclass.__qualname__ = name
        setattr(sys.modules[__name__], name, subclass)
        _CLASSES[cls] = subclass
    return _CLASSES[cls]


def save_unsharded_checkpoints(model: nn.Module) -> bool:
    """Gives a Hugging Face model (one with ``save_pretrained``) the methods
    above; returns whether it did."""
    if not callable(getattr(model, "save_pretrained", None)):
        return False
    model.__class__ = parallel_class(type(model))
    return True
