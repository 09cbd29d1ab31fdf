"""``parallelize``: applies a plan to a model in place."""
import warnings
from typing import Dict, List, Tuple, Union

import torch
from torch import nn

from ...distributed import collectives
from ...distributed import state
from ...distributed import mappings
from ...utils.shard_facts import named_parameter_shards, registered_shards
from ..linear import ParallelLinear
from ..parallel.plain_ddp import register_ddp_parameters_to_ignore
from .layers import (ColumnProjection, ReplicatedKeyValue, RowProjection, SharedInputCopy,
                     draw_dropout_from_model_parallel_stream, gather_sequence_after, gather_sequence_before,
                     scatter_sequence_before)
from .left_whole import WARNED, describe, left_whole
from .loss import install_loss
from .norms import gradients_summed_by_a_hook
from .plan import Placement, read_again, resolve
from .declared_plan import declared_plan
from .report import parameter_bytes, print_report
from .hf_methods import parallel_hf_methods
from .input_agreement import check_inputs_at_first_training_forward
from .logits import check_logits_option, gather_output_logits, generating
from .adapter_save import route_save_pretrained
from .lora import follow_split, lift_lora, lora_lifted, peft_base_model, refuse_adapters_that_cannot_follow
from .options_agree import check_options_agree, options_checked
from .miniature import prove_on_miniature
from . import proof
from . import proof_cache
from ...checkpoint.layout import model_layout
from .vocabulary import tie, vocabulary_parallel


def parallelize(model: nn.Module, plan: Union[str, Dict[str, str]] = "auto", group: str = state.TENSOR_PARALLEL,
                sequence_parallel: bool = False, verbose: bool = False, logits: str = "lazy",
                verify: bool = True, probe=None) -> nn.Module:
    """Shards ``model`` in place over the tensor-parallel ``group`` and returns it.

    Args:
        model: a model holding the same weights on every rank of the group
            (built under the same seed, or loaded), on its device.
        plan: "auto" (``auto_plan(model)``) or {qualified module name: style},
            styles as in ``STYLES``: "attention" and "mlp" (a known layout:
            Megatron's pairing, heads whole), "experts" (a bank of experts
            split along their intermediate dimension), "column" / "row" (one
            Linear or Conv1D), "vocab" (token embedding or LM head split by
            vocabulary rows, with every module tied to it; the head's logits
            stay sharded and marked), "replicate".
        group: the shardtorch group name ("tp").
        sequence_parallel: split the regions between blocks (norms, dropout,
            residuals) along the sequence (dim 1 of [batch, sequence, ...]):
            each attention and MLP all-gathers its input along the sequence
            and its row-parallel projection reduce-scatters, the first block
            takes this rank's slice and the last block's output is gathered
            whole again (same communication volume, activations 1/N there).
        verbose: print the plan, shard shapes, what stays whole, and the
            parameter memory of every rank against the whole model (printed
            by group rank 0; every rank of the group must pass the same).
        verify: prove the split before returning (proof.py): the whole model
            and then the parallel one run a small probe batch (eval, and
            training with dropout off), and their outputs and every
            parameter's gradient must agree within the dtype's bound, or
            ParallelizeProofError names where they differ first on every
            rank. ``False`` skips it: a model whose forward reads its weights
            in a way the layouts do not expect is then split silently wrong.
            A model on the meta device (from_pretrained, from_config) is
            proven on a miniature of its class instead (miniature.py), before
            it is split. A passed proof is kept on the machine, with the plan
            it proved, and the next parallelize of the same model checks its
            key instead and reads that plan again rather than resolving it
            (proof_cache.py; SHARDTORCH_PROOF_CACHE=0 proves every time).
        probe: the probe batch, ``(args, kwargs)`` or a kwargs dict, for a
            model whose inputs parallelize cannot tell (token ids for a
            model with a config and ``input_ids``, images for timm and
            torchvision vision models, ids or features for a model whose
            first layer is an embedding or a linear).
        logits: what the model returns in place of its logits (its own loss
            is computed from the shards in every mode). "lazy" (default): the
            unsharded model's logits, gathered from the ranks' shards when
            first read, on any rank (logits.py: a step that reads only the
            loss pays no gather); "whole": gathered along the vocabulary on
            every forward, for the positions computed; "sharded": the
            vocabulary shards, marked, for the parallel losses.

    A peft ``PeftModel`` is split through its base model (the plan names the
    base model's modules), its LoRA adapters split to match their projections
    (lora.py). The model's own forward runs unchanged: each attention's head-count
    attributes are set to its local heads. Options that differ between the
    ranks of the group (``plan``, ``sequence_parallel``, ``verbose``,
    ``logits``, ``verify``: checked by one small all-gather, each rank's value named)
    raise ValueError on every rank before any other collective; a bad plan, on every
    rank before anything is split. A Hugging Face LM called with
    ``labels=`` then computes its declared loss (causal, masked, or
    encoder-decoder) from the shards (loss.py), and returns the logits whole
    (``logits``). Attention, MLPs, experts and a vocabulary left whole are
    named in a warning. A Hugging Face model's ``save_pretrained`` (called on
    every rank) then writes the unsharded model's checkpoint
    (shardtorch.checkpoint.save_pretrained), and its ``generate`` checks that
    every rank of the group was given the same inputs.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"parallelize: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"parallelize: sequence_parallel must be a bool, got {sequence_parallel!r}")
    if not isinstance(group, str):
        raise TypeError(f"parallelize: group must be a shardtorch group name (str), got {group!r}")
    check_logits_option(logits)
    check_options_agree("parallelize", group, {"plan": plan, "sequence_parallel": sequence_parallel,
                                               "verbose": verbose, "logits": logits, "verify": verify})
    given, base = model, peft_base_model(model)
    model = model if base is None else base  # a PeftModel: its base model is split
    if base is not None:
        route_save_pretrained(given)  # peft's own would write each rank's slices
    size, rank = state.get_group_size(group), state.get_group_rank(group)
    on_meta = any(p.is_meta for p in model.parameters())
    remembered, placements = _proven_before(model, plan, verify, probe, on_meta, size, sequence_parallel, logits,
                                            group)
    if placements is None:
        # peft's adapter layers are lifted off their projections while the plan is read and applied (the
        # layouts know projections), and put back around the whole model the proof first runs.
        with lora_lifted(model) as lifted:
            placements = resolve(model, plan, size, sequence_parallel)
            refuse_adapters_that_cannot_follow(lifted, placements)
    blocks = _sequence_parallel_blocks(model, placements) if sequence_parallel else []
    if remembered is True:
        proving = None
    else:
        if verify is True and probe is None and on_meta:
            with options_checked(group), warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")  # the miniature's parallelize: these options, checked above
                proven = prove_on_miniature(model, placements, plan, group, sequence_parallel, logits, parallelize)
            for warning in said:
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
            if proven and remembered is not None:
                proof_cache.remember(remembered, [str(w.message) for w in said
                                                  if str(w.message).startswith("parallelize:")], model, placements)
        proving = _probe_before_split(model, placements, verify, probe, sequence_parallel, group)
    whole_bytes = parameter_bytes(model)
    modules = dict(model.named_modules())
    placed: List[Tuple[str, str, str]] = []
    replaced: Dict[int, tuple] = {}
    lifted = lift_lora(model)
    for placement in placements:
        name, style, module = placement.name, placement.style, placement.module
        if style == "replicate":
            placed.append((name, style, "whole"))
            continue
        if placement.layout is not None:
            layout, fit = placement.layout, placement.fit
            changed = layout.apply(module, fit, group, size, rank, sequence_parallel)
            if sequence_parallel:
                gather_sequence_before(layout.gather_point(module, fit), group)
            elif layout.head_dropout_region(module, fit) is not None:
                draw_dropout_from_model_parallel_stream(layout.head_dropout_region(module, fit))
            notes = ", ".join(f"{k}={v}" for k, v in changed.items())
            placed.append((name, f"{style} ({fit.variant})", notes))
            continue
        if style == "column":
            new = ColumnProjection(module, group, size, rank, SharedInputCopy(group, 1), unit=placement.unit)
        elif style == "row":
            new = RowProjection(module, group, size, rank, unit=placement.unit)
        else:
            new = vocabulary_parallel(module, group)
            for pname, spec in registered_shards(new).items():
                old = module._parameters[pname]
                if id(old) in replaced:  # tied to a module already split: share its shard
                    new._parameters[pname] = replaced[id(old)][1]
                replaced.setdefault(id(old), (old, new._parameters[pname], spec))
        _set_submodule(model, name, new)
        placed.append((name, style, ""))
    follow_split(lifted)
    if blocks:
        scatter_sequence_before(modules[blocks[0]], group)
        gather_sequence_after(modules[blocks[-1]], group)
        placed.append((f"{blocks[0]} .. {blocks[-1]}", "sequence-parallel region", "dim 1"))
        sum_partial_gradients(model, [modules[name] for name in blocks], group)
        for name in blocks:  # every activation inside is sharded: by heads, or by the sequence
            draw_dropout_from_model_parallel_stream(modules[name])
    tie(model, replaced)
    register_ddp_parameters_to_ignore(model)
    if given is not model:  # DDP around the PeftModel reads the list from it
        register_ddp_parameters_to_ignore(given)
    parallel_hf_methods(model, group)
    head = _parallel_head(model)
    vocabulary_head = head or _vocabulary_head(model, placements)
    # Also for a head Hugging Face's get_output_embeddings does not name: labels must not reach a forward that
    # would read the shards as whole logits.
    loss = install_loss(model, vocabulary_head, group) if vocabulary_head is not None else None
    if vocabulary_head is not None:  # "sharded": whole only inside generate
        gather_output_logits(model, vocabulary_head.weight.shape[0], vocabulary_head.out_features, group, logits)
    if proving is not None:
        _prove_after_split(model, placements, proving, group, sequence_parallel)
        if isinstance(remembered, str):
            proof_cache.remember(remembered, [], model, placements)
    # After the proof, whose training forwards would use up the one-time check.
    check_inputs_at_first_training_forward(model, group)
    whole = left_whole(model)
    warned = [describe(entry) for entry in whole if entry[2] in WARNED]
    if warned:
        warnings.warn("parallelize: left whole (each rank holds and computes all of it): " + "; ".join(warned))
    if verbose:
        rank_bytes = _bytes_per_rank(parameter_bytes(model), group, size)
        if rank == 0:
            print_report(model, placed, [describe(entry) for entry in whole], whole_bytes, loss, group, size,
                         rank_bytes)
    return given


def _proven_before(model, plan, verify, probe, on_meta, size, sequence_parallel, logits, group):
    """(True, the placements kept) when every rank has proven this split before (proof_cache.py; its
    warnings said again); else (the key to keep the proof under once it passes, or None when there is
    nothing to prove by it: verify off, a probe of the caller's; None). Every rank joins the agreement
    when verify is on, whatever its key."""
    if verify is not True or probe is not None:
        return None, None
    parameters = []
    try:
        digest = proof_cache.key(model, plan, declared_plan(model), "miniature" if on_meta else "whole",
                                 {"sequence_parallel": sequence_parallel, "logits": logits}, group, parameters)
    except Exception:  # noqa: BLE001 - a model the key cannot describe is proven every time, never refused
        digest = None
    found = proof_cache.proven(digest) if digest is not None else None
    placements = None
    if found is not None:
        try:
            with lora_lifted(model) as lifted:  # the layouts read projections, as when the plan was resolved
                placements = read_again(model, found[1], size, sequence_parallel)
                if placements is not None:
                    refuse_adapters_that_cannot_follow(lifted, placements)
        except Exception:  # noqa: BLE001 - a kept plan that no longer applies: resolved and proven anew
            placements = None
    if proof_cache.agree(digest, None if placements is None else found[1], parameters, group):
        proof_cache.say_again(found[0])
        return True, placements
    return digest, None


def _probe_before_split(model, placements, verify, probe, sequence_parallel, group):
    """The whole model's run of the probe batch (proof.py), or None when not proving. Every rank of the
    group agrees first, in one small all-gather, on whether it proves and on what its whole model gave:
    ranks that hold different weights (a model built without a common seed) are refused here, before
    anything is split."""
    if not isinstance(verify, bool):
        raise TypeError(f"parallelize: verify must be a bool, got {verify!r}")
    inputs, record = None, None
    if verify and not any(p.is_meta for p in model.parameters()):
        if probe is None:
            inputs = proof.probe_inputs(model)
            if inputs is None:
                _warn_not_proven(f"cannot tell the inputs of {type(model).__name__}")
        elif isinstance(probe, dict):
            inputs = ((), probe)
        elif isinstance(probe, tuple) and len(probe) == 2 and isinstance(probe[1], dict):
            inputs = (tuple(probe[0]), probe[1])
        else:
            raise TypeError(f"parallelize: probe must be a dict of keyword arguments or (args, kwargs), got "
                            f"{type(probe).__name__}")
    if inputs is not None:
        watched = {} if sequence_parallel else {p.name: p.module for p in placements if _whole_output(p)}
        # A guessed batch is tried with labels first (the loss the model's own forward computes is proven too).
        tries = [inputs] if probe is not None else [t for t in (proof.with_labels(model, inputs), inputs) if t]
        for n, candidate in enumerate(tries):
            try:
                record, inputs = proof.run_probe(model, candidate, watched, proof.whole_sketch), candidate
                break
            except Exception as error:  # noqa: BLE001 - a guessed batch the model does not take
                if probe is not None:
                    raise
                if n == len(tries) - 1:
                    _warn_not_proven(f"the whole {type(model).__name__} does not run on the probe batch parallelize "
                                     f"guessed ({type(error).__name__}: {error})")
    proof.agree_before_split(record, group)
    return None if record is None else (inputs, record)


def _warn_not_proven(why: str) -> None:
    warnings.warn(f"parallelize: {why}, so the split is not proven exact against the whole model: pass "
                  f"probe=(args, kwargs) (a small batch), or verify=False to skip the proof")


def _whole_output(placement: Placement) -> bool:
    """Whether the split module's output is whole, so that it compares with the whole model's."""
    if placement.layout is not None or placement.style == "row":
        return True
    return placement.style == "vocab" and isinstance(placement.module, nn.Embedding)


def _prove_after_split(model, placements, proving, group, sequence_parallel) -> None:
    inputs, whole = proving
    modules = dict(model.named_modules())
    watched = {name: modules[name] for name in whole.module_order if name in modules}
    layouts = model_layout(model)
    parallel = proof.Record()  # kept if it raises: which split module it raised in
    dtype, bound = proof.bound_for(model)
    try:
        with generating(model):  # whole logits in either logits mode
            proof.run_probe(model, inputs, watched, proof.parallel_sketch(layouts, group), record=parallel)
    except Exception as error:  # noqa: BLE001 - the whole model ran this batch: the split is at fault
        failures = proof.raised(error, parallel)
        raise proof.ParallelizeProofError(proof.explain(failures, placements, dtype, bound, sequence_parallel),
                                          failures, dtype, bound) from error
    failures = proof.compare(whole, parallel, bound)
    error = proof.agree_on_error(max((e for _, _, e in failures), default=0.0), group)
    if error > bound:
        raise proof.ParallelizeProofError(proof.explain(failures, placements, dtype, bound, sequence_parallel),
                                          failures, dtype, bound)


def _bytes_per_rank(local: int, group: str, size: int) -> List[int]:
    """Every group rank's parameter bytes, in group rank order (one small all-gather)."""
    if size == 1:
        return [local]
    mine = torch.tensor([local], dtype=torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(size)]
    collectives.all_gather(everyone, mine, group=state.get_group(group))
    return [int(t) for t in everyone]


def sum_partial_gradients(model: nn.Module, blocks: List[nn.Module], group: str) -> None:
    """Under sequence parallelism the whole parameters inside the blocks (norms, the row projections' biases)
    see only this rank's part of the sequence, so each rank's gradient is a partial sum: a hook all-reduces it
    over the group (one all-reduce per such parameter in backward).

    The hooks go on the parameter tensors the block holds when it runs (a forward pre-hook puts them on any it
    has not seen), not on those it holds now: from_pretrained and from_config replace the meta parameters a
    model is split with by the real ones, and a hook on the meta tensor would be lost with it."""
    sharded = {id(p) for _, p, _ in named_parameter_shards(model)}
    summed = {id(p) for m in model.modules() if isinstance(m, ReplicatedKeyValue) or gradients_summed_by_a_hook(m)
              for p in m.parameters(recurse=False)}
    # peft's LoRA layers around split projections (lora_layers.py) sum their whole factors' gradients themselves.
    summed |= {id(p) for m in model.modules() if hasattr(m, "factors_summed_over_group")
               for p in m.factors_summed_over_group()}
    seen = set()
    for block in blocks:
        names = []
        for name, param in block.named_parameters():
            if id(param) in sharded or id(param) in summed or id(param) in seen or not param.requires_grad:
                continue
            seen.add(id(param))
            names.append(name)
        if names:
            _sum_gradients_of(block, names, group)


_SUMMED_MARK = "_shardtorch_partial_gradient_summed"


def _sum_gradients_of(block: nn.Module, names: List[str], group: str) -> None:
    def hook_current(module, args):
        for name in names:
            param = module.get_parameter(name)
            # The mark is on the tensor: a tensor that replaces it has none and gets its own hook.
            if param.requires_grad and not getattr(param, _SUMMED_MARK, False):
                param.register_hook(lambda grad: mappings.reduce(grad, group))
                setattr(param, _SUMMED_MARK, True)
    hook_current(block, ())
    block.register_forward_pre_hook(hook_current)


def _sequence_parallel_blocks(model: nn.Module, placements: List[Placement]) -> List[str]:
    """The blocks (parents of the planned attention modules) in model order: the sequence-parallel region
    runs from the first one's input to the last one's output."""
    modules = list(dict(model.named_modules()))
    parents = {p.name.rpartition(".")[0] for p in placements if p.style == "attention"}
    if not parents or "" in parents:
        raise ValueError("parallelize: sequence_parallel=True needs attention modules inside blocks in the plan "
                         f"(the blocks bound the sequence-parallel region), got plan "
                         f"{ {p.name: p.style for p in placements} }")
    if any(p.style in ("column", "row") for p in placements):
        raise ValueError("parallelize: sequence_parallel=True works with 'attention' and 'mlp' entries, not with "
                         "'column' / 'row' ones")
    return sorted(parents, key=modules.index)


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    if name == "":
        raise ValueError("parallelize: the root module itself cannot be given the style 'column', 'row' or "
                         "'vocab'; name it inside a container")
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    setattr(parent, child, new)


def _vocabulary_head(model: nn.Module, placements):
    """The LM head the plan split by vocabulary (a model without Hugging Face's get_output_embeddings)."""
    for placement in placements:
        if placement.style == "vocab" and placement.name:
            module = model.get_submodule(placement.name)
            if isinstance(module, ParallelLinear) and module.dim in (1, -1):
                return module
    return None


def _parallel_head(model: nn.Module):
    """The model's LM head (Hugging Face's output embeddings) if it is now vocabulary-parallel, else None."""
    getter = getattr(model, "get_output_embeddings", None)
    if not callable(getter):
        return None
    try:
        head = getter()
    except (NotImplementedError, AttributeError):
        return None
    return head if isinstance(head, ParallelLinear) and head.dim in (1, -1) else None
