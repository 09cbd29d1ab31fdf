"""Optimizer state that follows the shards.

collect_optimizer_state_dict / relocate_optimizer_state_dict are the optimizer
twins of collect_state_dict / relocate_state_dict. The collected form is what
the same optimizer over the unsharded model holds: ``optimizer.state_dict()``'s
``{"state": {index: {...}}, "param_groups": [...]}``, every per-parameter
tensor shaped like the full parameter, plus torch's own ``param_names`` in each
group (the unsharded model's parameter names), so a plain single-process torch
program loads it with ``torch.optim.X(model.parameters()).load_state_dict``;
or, asked for, torch.distributed.checkpoint.state_dict's FQN-keyed form.

Which state is sharded follows from the parameter's layout (layout.py, read
from the layer that owns it): a state tensor shaped like a sharded parameter's
shard is sharded like it; a 0-d tensor (``step``) or a non-tensor is kept as
one value; any other tensor of a sharded parameter cannot be classified and
raises. State of replicated parameters is taken from one replica (checked
identical across ranks under SHARDTORCH_DEBUG=1).

- params.py: the optimizer's parameters, their names and layout; state kinds.
- forms.py: integer-id keyed and FQN keyed state dicts, one into the other.
- checks.py: the checks every call makes on every rank, and the error.
- local.py: this rank's state (ZeRO consolidated), agreed on by every rank.
- plan.py: a full state checked against this optimizer; the one loading loop.
- collect.py, relocate.py: the two public functions.
- entries.py: the state as checkpoint entries and its meta, for both formats.
- sharded.py, dcp.py: the glue to save_sharded/load_sharded and save_dcp/load_dcp.
"""
from .checks import OptimizerStateMismatchError
from .collect import collect_optimizer_state_dict
from .relocate import relocate_optimizer_state_dict
from .sharded import load_sharded_optimizer_state_dict

__all__ = ["OptimizerStateMismatchError", "collect_optimizer_state_dict", "relocate_optimizer_state_dict",
           "load_sharded_optimizer_state_dict"]
