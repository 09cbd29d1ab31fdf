"""LoRA with peft on a parallelized model, in either order (docs/fine-tuning.md).

- parallelize (or from_pretrained), then peft: ``get_peft_model(model, ts.nn.lora_config(LoraConfig(...)))``.
  ``lora_config`` registers shardtorch's sharded LoRA layers (lora_layers.py) as the config's custom
  modules, peft's public extension point; peft then draws each adapter whole, as on the unsharded
  model, and the layer keeps this rank's slices.
- peft, then parallelize: ``parallelize(peft_model)`` splits the PeftModel's base model (the plan names
  the base model's modules, as ``auto_plan(peft_model)`` gives them). peft's LoRA layers are lifted off
  their projections while the plan is read and applied, so the layouts see the projections they know,
  and each LoRA layer whose projection was split then follows it (``shard_lora_layer``).

peft is imported only where a model or a config of its own is given.
"""
import contextlib
import sys
from typing import Iterator, List, Tuple

from torch import nn

from .layers import is_projection


def lora_config(config):
    """Registers shardtorch's sharded LoRA layers with a peft ``LoraConfig`` (its custom module mapping)
    and returns it, for ``get_peft_model`` on a parallelized model. The adapters then follow the projections' split; plain LoRA only
    (init_lora_weights True, False or "gaussian"; no lora_bias, no DoRA or other variant)."""
    from peft import LoraConfig
    if not isinstance(config, LoraConfig):
        raise TypeError(f"lora_config: config must be a peft.LoraConfig, got {type(config).__name__}")
    from .lora_layers import custom_module_mapping
    config._register_custom_module(custom_module_mapping())
    return config


def peft_base_model(model: nn.Module):
    """The model a peft ``PeftModel`` wraps, or None for any other model."""
    peft = sys.modules.get("peft")
    if peft is None or not isinstance(model, peft.PeftModel):
        return None
    return model.get_base_model()


Lifted = List[Tuple[str, nn.Module, str, nn.Module]]


def lift_lora(model: nn.Module) -> Lifted:
    """Puts each peft adapter layer around a Linear or Conv1D aside, its base projection in its place;
    returns (qualified name, parent, attribute, adapter layer) of each, for ``put_back`` or ``follow_split``."""
    if "peft" not in sys.modules:
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer
    found = [(name, module) for name, module in model.named_modules()
             if isinstance(module, BaseTunerLayer) and is_projection(module.get_base_layer())]
    lifted = []
    for name, layer in found:
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attribute, layer.get_base_layer())
        lifted.append((name, parent, attribute, layer))
    return lifted


def put_back(lifted: Lifted) -> None:
    """The adapter layers back around their projections, none of them split."""
    for _, parent, attribute, layer in lifted:
        setattr(parent, attribute, layer)


@contextlib.contextmanager
def lora_lifted(model: nn.Module) -> Iterator[Lifted]:
    """Inside, the adapter layers are lifted off their projections (``lift_lora``: the layouts read the
    projections they know); put back on the way out, whatever happens."""
    lifted = lift_lora(model)
    try:
        yield lifted
    finally:
        put_back(lifted)


def follow_split(lifted: Lifted) -> None:
    """The adapter layers back in place; each whose projection was split becomes the sharded LoRA layer
    around the split one."""
    from .lora_layers import shard_lora_layer
    for _, parent, attribute, layer in lifted:
        base = getattr(parent, attribute)
        if base is not layer.get_base_layer():
            layer = shard_lora_layer(layer, base)
        setattr(parent, attribute, layer)


def refuse_adapters_that_cannot_follow(lifted: Lifted, placements) -> None:
    """ValueError naming every adapter layer inside a module the plan splits that cannot follow the split
    (on every rank alike: it reads the model and the plan only), before anything is split."""
    if not lifted:
        return
    from .lora_layers import refusal_to_follow
    split = [(p.name, p.style) for p in placements if p.style != "replicate"]
    problems = []
    for name, _, _, layer in lifted:
        owner = next(((n, s) for n, s in split if name == n or name.startswith(n + ".") or n == ""), None)
        if owner is None:
            continue
        reason = (f"the {owner[1]!r} style splits it by vocabulary, and adapters on the vocabulary are not split"
                  if owner[1] == "vocab" else refusal_to_follow(layer))
        if reason is not None:
            problems.append(f"{name!r}: {reason}")
    if problems:
        raise ValueError("parallelize: peft adapters cannot follow the split of their projections: "
                         + "; ".join(problems) + " (leave those modules out of the LoraConfig's target_modules, "
                         "or give them the style 'replicate')")
