"""What a model computes, as a digest: its modules (each one's class, attributes, parameters' and
buffers' shapes and dtypes, which parameters are one tensor, hooks), its config, the values the
classes of its modules and of the objects they hold define (what a layout or a forward may read through
an instance, named by the code or not; an installed package's classes by their file's stamp), and the
Python code its modules' classes reach
(utils/code_identity/: forward, __call__, the methods of their own files, and what those reach by
name). The proof's cache (proof_cache.py) keys a proven split by it, with the plan and the options;
the weights' values are not part of it (the proof checks how the split reads weights, which does not
depend on them, as a miniature's proof already assumes).

Attributes count by value where they are simple (a head count, a flag, a tuple of sizes), by class
and attributes otherwise; buffers (rotary frequencies, masks) by their contents too, a large one by an
evenly spaced sample.
"""
import hashlib
from typing import Optional

from torch import nn

from ...utils.code_identity import Description, reachable_code_digest


def model_digest(model: nn.Module, parameters: Optional[list] = None) -> bytes:
    """The digest of what ``model`` computes (module docstring); ``parameters``, a list, receives every
    parameter described, once each."""
    description = Description()
    for name, module in model.named_modules(remove_duplicate=False):
        if id(module) not in description.seen:
            description.seen[id(module)] = (len(description.seen), module)
        description.module(name, module)
    config = getattr(model, "config", None)
    if config is not None:
        description.text("config")
        description.value(config)
    from torch.nn.modules import module as torch_module
    for key in ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                "_global_backward_hooks"):
        description.hooks(getattr(torch_module, key, None), 0)
    digest = hashlib.sha256("\0".join(description.parts).encode())
    digest.update(reachable_code_digest(description.starts))
    if parameters is not None:
        parameters.extend(p for _, p in description.parameters.values())
    return digest.digest()
