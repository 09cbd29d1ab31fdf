"""Optimizer state across launches of different sizes (test_optimizer_state.py).

A launch at size A trains K_STEPS with each optimizer, checks the collected
model and optimizer state against the unsharded float64 reference, and saves
(collected files and save_sharded). A later launch at size B loads them into a
fresh model and optimizer, trains M_STEPS more and checks everything against
the uninterrupted unsharded run. Errors go to SHARDTORCH_OPTIM_STATE_DIR/errors-*.json. The row-sparse optimizers'
state (shardtorch.optim) runs in the same launches (cases_row_sparse_state.py)."""
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict, get_state_dict,
                                                     set_optimizer_state_dict)

import shardtorch as ts
from tests.distributed.optimizer_models import (FRESH_SEED, K_STEPS, M_STEPS, OPTIMIZERS, SAVED_SEED, build,
                                                make_optimizer, max_error, reference, train)
from tests.distributed.checkpoint_models import die_after_writing_shard_file
from tests.distributed.cases_row_sparse_state import (  # noqa: F401  (run in these launches)
    case_row_sparse_load_2, case_row_sparse_load_4, case_row_sparse_misshapen_row_state_fails_on_every_rank,
    case_row_sparse_state_saves_and_resumes_bitwise)
from tests.reference import expect_error

TOLERANCE = 1e-12


def _dir(*parts):
    return os.path.join(os.environ["SHARDTORCH_OPTIM_STATE_DIR"], *parts)


def _tag():
    world, size = dist.get_world_size(), ts.distributed.get_group_size()
    return str(size) if world == size else f"{world // size}x{size}"


def _record(what, kind, model_error, state_error):
    assert model_error <= TOLERANCE and state_error <= TOLERANCE, \
        f"{what} {kind}: parameter error {model_error:.3g}, state error {state_error:.3g} > {TOLERANCE}"
    if dist.get_rank() == 0:
        path = _dir(f"errors-{what}-{kind}.json")
        with open(path, "w") as f:
            json.dump({"what": what, "optimizer": kind, "param": model_error, "state": state_error}, f)


def _check_against_reference(model, optimizer, kind, steps, what):
    """Collected on every rank (dst=None) and on each dst, against the unsharded run."""
    ref_model, ref_optimizer = reference(kind, steps)
    full_model = ts.collect_state_dict(model, model.state_dict())
    full_optimizer = ts.collect_optimizer_state_dict(model, optimizer)
    model_error = max_error(full_model, ref_model.state_dict(), f"{what} {kind} model")
    state_error = max_error(full_optimizer, ref_optimizer.state_dict(), f"{what} {kind} optimizer")
    names = [n for g in full_optimizer["param_groups"] for n in g["param_names"]]
    assert names == [n for g in ref_optimizer.param_groups for n, p in ref_model.named_parameters()
                     if any(p is q for q in g["params"])], names
    only = ts.collect_optimizer_state_dict(model, optimizer, dst=dist.get_world_size() - 1)
    if dist.get_rank() == dist.get_world_size() - 1:
        state_error = max(state_error, max_error(only, ref_optimizer.state_dict(), f"{what} {kind} dst"))
    else:
        assert only is None
    _record(what, kind, model_error, state_error)


# ------------------------------------------------------------------ saving at size A
def _train_check_and_save(model, optimizer, kind, what, name):
    """K_STEPS of training checked against the reference, then saved both
    ways: collected (full-<name>.pt, rank 0) and sharded (sharded-<name>).
    Returns what the two collects returned on this rank."""
    train(model, optimizer, range(K_STEPS))
    _check_against_reference(model, optimizer, kind, K_STEPS, what)
    full = {"model": ts.collect_state_dict(model, model.state_dict(), dst=0),
            "optimizer": ts.collect_optimizer_state_dict(model, optimizer, dst=0)}
    if dist.get_rank() == 0:
        torch.save(full, _dir(f"full-{name}.pt"))
    ts.save_sharded(model, _dir(f"sharded-{name}"), optimizer=optimizer)
    return full


def case_train_check_and_save():
    tag = _tag()
    for kind in OPTIMIZERS:
        model = build(True, SAVED_SEED)
        optimizer = make_optimizer(kind, model)
        _train_check_and_save(model, optimizer, kind, f"trained-at-{tag}", f"{kind}-{tag}")


# ------------------------------------------------------------------ loading at size B
def _load_and_continue(tag, kinds=tuple(OPTIMIZERS), prefix=""):
    for kind in kinds:
        # From the collected files, through relocate.
        model = build(True, FRESH_SEED)
        optimizer = make_optimizer(kind, model)
        full = torch.load(_dir(f"full-{prefix}{kind}-{tag}.pt"), weights_only=True) \
            if dist.get_rank() == 0 else None
        model.load_state_dict(ts.relocate_state_dict(model, full and full["model"]))
        optimizer.load_state_dict(ts.relocate_optimizer_state_dict(model, optimizer, full and full["optimizer"]))
        train(model, optimizer, range(K_STEPS, K_STEPS + M_STEPS))
        _check_against_reference(model, optimizer, kind, K_STEPS + M_STEPS,
                                 f"relocated-{prefix}{tag}-to-{_tag()}")
        # From the sharded checkpoint, through load_sharded.
        model = build(True, FRESH_SEED)
        optimizer = make_optimizer(kind, model)
        ts.load_sharded(model, _dir(f"sharded-{prefix}{kind}-{tag}"), optimizer=optimizer)
        train(model, optimizer, range(K_STEPS, K_STEPS + M_STEPS))
        _check_against_reference(model, optimizer, kind, K_STEPS + M_STEPS,
                                 f"load_sharded-{prefix}{tag}-to-{_tag()}")


def case_load_1():
    _load_and_continue("1")


def case_load_2():
    _load_and_continue("2")


def case_load_4():
    _load_and_continue("4")


def case_load_2x2():
    _load_and_continue("2x2")


def case_load_3():
    _load_and_continue("3")


# ------------------------------------------------------------------ wrong or partial state



def case_wrong_optimizer_state_fails_on_every_rank():
    """Every rank raises, naming what differs; the ranks stay in step after."""
    model, adam_model = build(True, FRESH_SEED), build(False, SAVED_SEED)
    src = dist.get_world_size() - 1
    plain_adam = make_optimizer("adam", adam_model)
    train(adam_model, plain_adam, range(2))
    good = plain_adam.state_dict()          # a plain torch optimizer's state: matched by position
    on_src = lambda sd: sd if dist.get_rank() == src else None  # noqa: E731
    optimizer = make_optimizer("adam", model)

    def relocate(sd, **kw):
        return ts.relocate_optimizer_state_dict(model, optimizer, on_src(sd), src=src, **kw)

    # Another optimizer class: SGD's state into Adam, Adam's into RMSprop.
    sgd_model = build(False, SAVED_SEED)
    sgd = make_optimizer("sgd_momentum", sgd_model)
    train(sgd_model, sgd, range(1))
    expect_error(lambda: relocate(sgd.state_dict()), "another optimizer class", "missing ['amsgrad'")
    rms = make_optimizer("rmsprop", model)
    expect_error(lambda: ts.relocate_optimizer_state_dict(model, rms, on_src(good), src=src),
                  "another optimizer class", "centered")
    # AdamW's state into Adam: same keys, another variant.
    adamw_model = build(False, SAVED_SEED)
    adamw = make_optimizer("adamw", adamw_model)
    expect_error(lambda: relocate(adamw.state_dict()), "decoupled_weight_decay=True in the state")
    # A missing parameter, by name (collected state) and by position (plain state).
    collected = ts.collect_optimizer_state_dict(model, make_optimizer("adam", model), dst=src)
    named = {"state": {}, "param_groups": [dict(g) for g in (collected or good)["param_groups"]]}
    if collected is not None:
        named["param_groups"][1]["param_names"] = named["param_groups"][1]["param_names"][1:]
        named["param_groups"][1]["params"] = named["param_groups"][1]["params"][1:]
        expect_error(lambda: relocate(named), "missing parameter 'up.weight'")
    else:
        expect_error(lambda: relocate(None), "missing parameter 'up.weight'")
    short = {"state": good["state"], "param_groups": [dict(g) for g in good["param_groups"]]}
    short["param_groups"][0]["params"] = short["param_groups"][0]["params"][:-1]
    expect_error(lambda: relocate(short), "group 0 has 2 parameters in the state but 3 here", "'head.weight'")
    # Other param_groups: one group instead of two.
    merged = {"state": good["state"], "param_groups": [dict(good["param_groups"][0])]}
    merged["param_groups"][0]["params"] = [i for g in good["param_groups"] for i in g["params"]]
    expect_error(lambda: relocate(merged), "1 parameter group(s), this Adam has 2")
    # Partial state: one parameter's state gone, or one of its tensors.
    partial = {"state": dict(good["state"]), "param_groups": good["param_groups"]}
    del partial["state"][3]   # up.weight
    expect_error(lambda: relocate(partial), "parameter 'up.weight' has no state", "partial")
    partial["state"] = dict(good["state"])
    partial["state"][3] = {k: v for k, v in good["state"][3].items() if k != "exp_avg_sq"}
    expect_error(lambda: relocate(partial), "'up.weight' has state", "missing ['exp_avg_sq']")
    # A state tensor of the wrong full shape.
    misshapen = {"state": dict(good["state"]), "param_groups": good["param_groups"]}
    misshapen["state"][3] = dict(good["state"][3], exp_avg=torch.zeros(11, 5, dtype=torch.float64))
    expect_error(lambda: relocate(misshapen), "'up.weight' state 'exp_avg' has shape (11, 5)", "(11, 6)")
    expect_error(lambda: relocate({"model": 1}), "must pass an optimizer state dict")
    expect_error(lambda: ts.relocate_optimizer_state_dict(model, optimizer, good, src=99), "src must be")
    # torch.distributed.checkpoint.state_dict's FQN-keyed form: other names, ids mixed with names, flattened.
    fqn = get_optimizer_state_dict(adam_model, plain_adam)
    rename = lambda n: "up.weights" if n == "up.weight" else n  # noqa: E731
    renamed = {"state": {rename(k): v for k, v in fqn["state"].items()},
               "param_groups": [dict(g, params=[rename(n) for n in g["params"]]) for g in fqn["param_groups"]]}
    expect_error(lambda: relocate(renamed), "missing parameter 'up.weight'",
                 "unexpected parameter 'up.weights' that this optimizer does not hold")
    mixed = {"state": fqn["state"], "param_groups": [dict(g) for g in fqn["param_groups"]]}
    mixed["param_groups"][0]["params"] = [0] + mixed["param_groups"][0]["params"][1:]
    expect_error(lambda: relocate(mixed), "group 0 lists both parameter names", "and integer ids [0]")
    twice = {"state": fqn["state"], "param_groups": [dict(g) for g in fqn["param_groups"]]}
    twice["param_groups"][0]["params"] = twice["param_groups"][0]["params"] + ["up.weight"]
    expect_error(lambda: relocate(twice), "parameter 'up.weight' is listed twice in the param_groups")
    stray = {"state": {**fqn["state"], "nope.weight": fqn["state"]["up.weight"]}, "param_groups": fqn["param_groups"]}
    expect_error(lambda: relocate(stray), "state for parameter(s) ['nope.weight'] that no parameter group lists")
    flat = get_optimizer_state_dict(adam_model, plain_adam,
                                    options=StateDictOptions(flatten_optimizer_state_dict=True))
    expect_error(lambda: relocate(flat), "must pass an optimizer state dict", "torch's flattened form")
    # collect's state_dict= (this rank's state, FQN-keyed) naming the parameters in another order.
    local = get_optimizer_state_dict(model, make_optimizer("adam", model))
    swapped = {"state": local["state"], "param_groups": [dict(g) for g in local["param_groups"]]}
    swapped["param_groups"][1]["params"] = swapped["param_groups"][1]["params"][::-1]
    expect_error(lambda: ts.collect_optimizer_state_dict(model, optimizer, state_dict=swapped),
                 "group 1 of state_dict names parameters ['norm.bias'", "the optimizer holds ['up.weight'")
    # An optimizer over parameters that are not the model's.
    stranger = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    expect_error(lambda: ts.collect_optimizer_state_dict(model, stranger), "not the model's")
    # Still in step: a good one loads and equals the plain optimizer's state.
    optimizer.load_state_dict(relocate(good))
    full = ts.collect_optimizer_state_dict(model, optimizer)
    assert max_error(full, good, "after errors") == 0.0


def case_collect_refuses_disagreeing_ranks():
    """A rank whose optimizer holds other state than its peers' fails everywhere."""
    if dist.get_world_size() < 2:
        return
    model = build(True, SAVED_SEED)
    optimizer = make_optimizer("sgd_momentum", model)
    train(model, optimizer, range(1))
    if dist.get_rank() == 1:
        del optimizer.state[model.up.weight]["momentum_buffer"]
    expect_error(lambda: ts.collect_optimizer_state_dict(model, optimizer),
                  "parameter 'up.weight' has state [] on rank 1, ['momentum_buffer'] on rank 0")


def case_replicas_that_disagree_are_named_under_debug():
    """State of a replicated parameter is taken from one replica; under
    SHARDTORCH_DEBUG=1 the ranks compare it and name a replica that differs."""
    if dist.get_world_size() < 2:
        return
    model = build(True, SAVED_SEED)
    optimizer = make_optimizer("sgd_momentum", model)
    train(model, optimizer, range(1))
    if dist.get_rank() == 1:
        optimizer.state[model.norm.weight]["momentum_buffer"].add_(1e-9)
    ts.collect_optimizer_state_dict(model, optimizer, dst=0)  # not compared: rank 0's is taken
    os.environ["SHARDTORCH_DEBUG"] = "1"
    try:
        expect_error(lambda: ts.collect_optimizer_state_dict(model, optimizer, dst=0),
                      "parameter 'norm.weight' state ['momentum_buffer'] differs between rank 0 and rank 1",
                      "replicas must agree")
    finally:
        del os.environ["SHARDTORCH_DEBUG"]


# ------------------------------------------------------------------ a save killed midway
def case_save_with_optimizer_then_die_midway():
    """Saves model and optimizer state, then starts another save and dies
    (os._exit: no cleanup) right after writing its shard file."""
    path = _dir("killed")
    model = build(True, SAVED_SEED)
    optimizer = make_optimizer("adam", model)
    train(model, optimizer, range(K_STEPS))
    ts.save_sharded(model, path, optimizer=optimizer)
    train(model, optimizer, range(K_STEPS, K_STEPS + 1))
    die_after_writing_shard_file()
    ts.save_sharded(model, path, optimizer=optimizer)


def case_load_after_killed_save():
    model = build(True, FRESH_SEED)
    optimizer = make_optimizer("adam", model)
    ts.load_sharded(model, _dir("killed"), optimizer=optimizer)
    _check_against_reference(model, optimizer, "adam", K_STEPS, f"after-killed-save-at-{_tag()}")
    # A checkpoint without optimizer state is refused for an optimizer, with that reason.
    plain_path = _dir(f"model-only-{_tag()}")
    ts.save_sharded(model, plain_path)
    expect_error(lambda: ts.load_sharded(model, plain_path, optimizer=optimizer), "holds no optimizer state")
    # Another optimizer class is refused from a sharded checkpoint too, on every rank.
    sgd = make_optimizer("sgd_momentum", model)
    expect_error(lambda: ts.load_sharded(model, _dir("killed"), optimizer=sgd),
                  "the checkpoint holds Adam state, this optimizer is a SGD")


# ------------------------------------------------------------------ ZeroRedundancyOptimizer
ZERO_KINDS = {"sgd_momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1)),
              "adam": (torch.optim.Adam, dict(lr=0.01, amsgrad=True))}


def _make_zero(kind, model):
    """ZeroRedundancyOptimizer over the data-parallel group, with the groups
    and hyperparameters of make_optimizer(kind, ...)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from tests.distributed.optimizer_models import param_groups
    cls, kwargs = ZERO_KINDS[kind]
    groups = param_groups(model)
    zero = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=cls,
                                   process_group=ts.distributed.get_data_parallel_group(), **kwargs)
    zero.add_param_group(groups[1])
    zero.param_groups[0]["lr"] *= 0.5
    return zero


def case_zero_train_check_save_and_reload():
    """State spread over the data-parallel group by ZeRO: collected, it is the
    unsharded optimizer's; relocated or loaded into a fresh ZeRO it continues."""
    tag = _tag()
    for kind in ZERO_KINDS:
        model = build(True, SAVED_SEED)
        zero = _make_zero(kind, model)
        full = _train_check_and_save(model, zero, kind, f"zero-trained-at-{tag}", f"zero-{kind}-{tag}")
        full = full if dist.get_rank() == 0 else None

        model = build(True, FRESH_SEED)
        zero = _make_zero(kind, model)
        model.load_state_dict(ts.relocate_state_dict(model, full and full["model"]))
        zero.load_state_dict(ts.relocate_optimizer_state_dict(model, zero, full and full["optimizer"]))
        train(model, zero, range(K_STEPS, K_STEPS + M_STEPS))
        _check_against_reference(model, zero, kind, K_STEPS + M_STEPS, f"zero-relocated-{tag}-to-{tag}")

        model = build(True, FRESH_SEED)
        zero = _make_zero(kind, model)
        ts.load_sharded(model, _dir(f"sharded-zero-{kind}-{tag}"), optimizer=zero)
        train(model, zero, range(K_STEPS, K_STEPS + M_STEPS))
        _check_against_reference(model, zero, kind, K_STEPS + M_STEPS, f"zero-load_sharded-{tag}-to-{tag}")


def case_load_zero_2x2():
    """A plain optimizer at another size continues from ZeRO's state."""
    _load_and_continue("2x2", kinds=tuple(ZERO_KINDS), prefix="zero-")


# ------------------------------------------------------------------ torch.distributed.checkpoint
DCP_KINDS = ("sgd_nesterov", "adam", "rmsprop")


def case_save_dcp_with_optimizer():
    for kind in DCP_KINDS:
        model = build(True, SAVED_SEED)
        optimizer = make_optimizer(kind, model)
        train(model, optimizer, range(K_STEPS))
        ts.checkpoint.save_dcp(model, _dir(f"dcp-{kind}-{_tag()}"), optimizer=optimizer)


def case_load_dcp_with_optimizer_2x2():
    for kind in DCP_KINDS:
        model = build(True, FRESH_SEED)
        optimizer = make_optimizer(kind, model)
        ts.checkpoint.load_dcp(model, _dir(f"dcp-{kind}-2x2"), optimizer=optimizer)
        train(model, optimizer, range(K_STEPS, K_STEPS + M_STEPS))
        _check_against_reference(model, optimizer, kind, K_STEPS + M_STEPS, f"load_dcp-2x2-to-{_tag()}")
    model = build(True, FRESH_SEED)
    expect_error(lambda: ts.checkpoint.load_dcp(model, _dir("dcp-adam-2x2"),
                                                 optimizer=make_optimizer("sgd_momentum", model)),
                  "the checkpoint holds Adam state, this optimizer is a SGD")


# ------------------------------------------------------------------ torch.distributed.checkpoint.state_dict
def case_torch_fqn_state_round_trip():
    """torch.distributed.checkpoint.state_dict's FQN-keyed form, both ways.
    Out: collected here with fqn_keys=True it equals get_optimizer_state_dict
    of the unsharded reference, and single-process torch's
    set_optimizer_state_dict loads it into a plain optimizer that continues as
    the uninterrupted run. In: get_state_dict of the unsharded reference
    relocates here (loaded through set_optimizer_state_dict) and continues as
    the uninterrupted run. And get_optimizer_state_dict of this sharded model
    (this rank's shards, FQN-keyed) collects to the same full state."""
    tag, src = _tag(), dist.get_world_size() - 1
    for kind in OPTIMIZERS:
        model = build(True, SAVED_SEED)
        optimizer = make_optimizer(kind, model)
        train(model, optimizer, range(K_STEPS))
        ref_model, ref_optimizer = reference(kind, K_STEPS)
        ref_model_sd, ref_fqn = get_state_dict(ref_model, ref_optimizer)
        # this rank's shards as torch names them, collected: exactly the optimizer's own collect
        local = get_optimizer_state_dict(model, optimizer)
        assert all(isinstance(k, str) for k in local["state"]), list(local["state"])
        from_local = ts.collect_optimizer_state_dict(model, optimizer, state_dict=local)
        assert max_error(from_local, ts.collect_optimizer_state_dict(model, optimizer), f"{kind} from local") == 0.0
        # out: collected FQN-keyed -> plain single-process torch
        full_model = ts.collect_state_dict(model, model.state_dict(), dst=0)
        collected = ts.collect_optimizer_state_dict(model, optimizer, dst=0, fqn_keys=True)
        if dist.get_rank() == 0:
            assert sorted(collected["state"]) == sorted(ref_fqn["state"]), sorted(collected["state"])
            out_error = max_error(collected, ref_fqn, f"{kind} fqn_keys vs torch's form")
            plain = build(False, FRESH_SEED)
            plain_optimizer = make_optimizer(kind, plain)
            plain.load_state_dict(full_model)
            set_optimizer_state_dict(plain, plain_optimizer, collected)
            train(plain, plain_optimizer, range(K_STEPS, K_STEPS + M_STEPS))
            end_model, end_optimizer = reference(kind, K_STEPS + M_STEPS)
            _record(f"fqn-collected-at-{tag}-to-plain-torch", kind,
                    max_error(plain.state_dict(), end_model.state_dict(), f"{kind} plain model"),
                    max(out_error, max_error(plain_optimizer.state_dict(), end_optimizer.state_dict(),
                                             f"{kind} plain optimizer")))
        else:
            assert collected is None
        # in: torch's form of the unsharded reference -> this size
        model = build(True, FRESH_SEED)
        optimizer = make_optimizer(kind, model)
        on_src = dist.get_rank() == src
        model.load_state_dict(ts.relocate_state_dict(model, ref_model_sd if on_src else None, src=src))
        relocated = ts.relocate_optimizer_state_dict(model, optimizer, ref_fqn if on_src else None, src=src)
        set_optimizer_state_dict(model, optimizer, relocated)
        train(model, optimizer, range(K_STEPS, K_STEPS + M_STEPS))
        _check_against_reference(model, optimizer, kind, K_STEPS + M_STEPS, f"torch-fqn-relocated-to-{tag}")
