"""``save_adapter``: a parallelized PeftModel's adapter written as the unsharded model's plain peft adapter.

peft's own ``save_pretrained`` writes the state dict this rank holds: on a split model, its slices of
the adapters, under the whole adapter's names, from every rank into the same files. So the tensors peft
would save (its own selection: LoRA factors, modules_to_save) are gathered whole, over each
tensor-parallel group by their shard facts, to global rank 0, which hands them to peft's
``save_pretrained`` (``state_dict=``): the files, names and adapter_config.json are peft's.
"""
import os

import torch
from torch import nn

from ...checkpoint.layout import model_layout
from ...checkpoint.transfers import gather_to
from ...distributed import collectives
from ...distributed import state


def _adapter_entries(peft_model: nn.Module, adapter_names) -> dict:
    """The entries of this rank's state dict that peft saves for ``adapter_names``, under the model's keys
    (found by identity in what peft's get_peft_model_state_dict picks, so its rules decide)."""
    from peft.utils import get_peft_model_state_dict
    local = peft_model.state_dict()
    picked = set()
    for name in adapter_names:
        picked.update(id(t) for t in get_peft_model_state_dict(peft_model, state_dict=local,
                                                                adapter_name=name).values())
    return {key: tensor for key, tensor in local.items() if id(tensor) in picked}


def save_adapter(peft_model: nn.Module, save_directory: str, **kwargs) -> None:
    """Writes the adapters of a parallelized ``peft_model`` to ``save_directory`` as peft's
    ``save_pretrained`` writes them for the unsharded model (whole tensors, peft's key names and
    config): ``PeftModel.from_pretrained(unsharded_model, save_directory)`` loads them.

    Collective: every rank of the world calls it (peft's own ``save_pretrained`` would write each
    rank's slices). Global rank 0 writes; ``kwargs`` go to peft's ``save_pretrained``
    (``selected_adapters``, ``safe_serialization``, ...). Returns once the files are written."""
    from peft import PeftModel
    if not isinstance(peft_model, PeftModel):
        raise TypeError(f"save_adapter: peft_model must be a peft.PeftModel, got {type(peft_model).__name__}")
    for reserved in ("state_dict", "is_main_process"):
        if reserved in kwargs:
            raise ValueError(f"save_adapter: {reserved}= is set by save_adapter (rank 0 writes the gathered "
                             f"adapter); leave it out")
    names = kwargs.get("selected_adapters") or list(peft_model.peft_config)
    entries = _adapter_entries(peft_model, names)
    if not entries:
        raise ValueError(f"save_adapter: peft finds no adapter tensors for the adapters {names} of this model")
    layout = model_layout(peft_model, entries)  # collective: every rank walks the same entries
    rank = state.get_rank()
    whole = {}
    for key, tensor in entries.items():
        full = gather_to(tensor, layout[key], 0) if layout[key].sharded else tensor
        if rank == 0:
            whole[key] = full
    if rank == 0:
        os.makedirs(save_directory, exist_ok=True)
        peft_model.save_pretrained(save_directory, state_dict=whole, is_main_process=True, **kwargs)
    if torch.distributed.is_initialized():
        collectives.barrier()  # the files exist on every rank's return


def route_save_pretrained(peft_model: nn.Module) -> None:
    """Makes ``peft_model.save_pretrained(directory, ...)`` (peft's, which would write each rank's slices)
    write the whole adapter through ``save_adapter``; a call that passes its own ``state_dict`` (as
    save_adapter's on rank 0 does) reaches peft's as it is."""
    own = type(peft_model).save_pretrained

    def save_pretrained(save_directory, *args, **kwargs):
        if args or "state_dict" in kwargs:
            return own(peft_model, save_directory, *args, **kwargs)
        return save_adapter(peft_model, save_directory, **kwargs)
    peft_model.save_pretrained = save_pretrained
