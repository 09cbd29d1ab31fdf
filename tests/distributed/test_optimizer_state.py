"""Optimizer state across sizes: train at size A, save, load at size B, train
more; every parameter and state tensor equal to the uninterrupted unsharded
float64 run within 1e-12 (cases_optimizer_state.py). Phases run once per session in this order
(beside test_checkpoint.py's where sizes and order allow: checkpoint_phases.py),
each loading what the previous one saved: 1 -> 2 -> 4 -> 2x2 -> 3 -> 1 (and a save
killed midway at 1, loaded at 2); at 2 and 3, torch.distributed.checkpoint.
state_dict's FQN-keyed form goes out to and comes in from single-process torch
(case_torch_fqn_state_round_trip); then the collected state continues in a
plain single-process torch optimizer. shardtorch.optim's RowSparseSGD / RowSparseAdam
state (per-row steps) rides the same launches: saved at 2 and 4 and resumed
bitwise at the same size, loaded at 4, 3 and 1 (cases_row_sparse_state.py)."""
import glob
import json
import os

import pytest
import torch

from tests.distributed import checkpoint_phases
from tests.distributed.harness import check_phases
from tests.distributed.optimizer_models import (FRESH_SEED, K_STEPS, M_STEPS, OPTIMIZERS, build, make_optimizer,
                                                max_error, reference, train)

MODULE = "tests.distributed.cases_optimizer_state"
ROW_SPARSE_SAVE = "case_row_sparse_state_saves_and_resumes_bitwise"
ERRORS = ["case_wrong_optimizer_state_fails_on_every_rank", "case_collect_refuses_disagreeing_ranks"]

# (world, tensor-parallel size, cases), in the order they must run.
PHASES = {
    "size1": (1, 1, ["case_train_check_and_save"] + ERRORS),
    # Saves model and optimizer state, then dies (os._exit(17)) in the middle of a second save.
    "killed_save": (1, 1, ["case_save_with_optimizer_then_die_midway"]),
    "size2_from1": (2, 2, ["case_load_1", "case_train_check_and_save", "case_load_after_killed_save",
                           "case_replicas_that_disagree_are_named_under_debug", "case_torch_fqn_state_round_trip",
                           ROW_SPARSE_SAVE, "case_row_sparse_misshapen_row_state_fails_on_every_rank"]
                    + ERRORS),
    "size4_from2": (4, 4, ["case_load_2", "case_train_check_and_save", "case_row_sparse_load_2", ROW_SPARSE_SAVE]
                    + ERRORS),
    "2x2_from4": (4, 2, ["case_load_4", "case_load_1", "case_train_check_and_save",
                         "case_zero_train_check_save_and_reload", "case_save_dcp_with_optimizer"]),
    "size3_from2x2": (3, 3, ["case_load_2x2", "case_load_zero_2x2", "case_load_dcp_with_optimizer_2x2",
                             "case_train_check_and_save", "case_torch_fqn_state_round_trip", "case_row_sparse_load_4"]),
    "size1_from3": (1, 1, ["case_load_3", "case_load_2x2", "case_row_sparse_load_2"]),
}


def test_every_case_runs_in_a_phase():
    """A case listed in no phase would never run: fail instead (the row-sparse
    cases that this module imports included)."""
    check_phases(MODULE, PHASES)


@pytest.fixture(scope="module")
def checkpoint_dir():
    """The folder the phases saved into (they have all run once it is given)."""
    return checkpoint_phases.folder(MODULE)


@pytest.mark.parametrize("phase", list(PHASES))
def test_optimizer_state_phase(phase):
    checkpoint_phases.check(MODULE, phase)


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_collected_state_continues_in_plain_torch(checkpoint_dir, kind):
    """No shardtorch call: the plain model and torch.optim.X load the state
    collected from 2 x 2 ranks and continue exactly as the uninterrupted run."""
    path = os.path.join(checkpoint_dir, f"full-{kind}-2x2.pt")
    if not os.path.exists(path):
        pytest.skip("the 2x2 phase did not run")
    saved = torch.load(path, weights_only=True)
    model = build(False, FRESH_SEED)
    optimizer = make_optimizer(kind, model)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    train(model, optimizer, range(K_STEPS, K_STEPS + M_STEPS))
    ref_model, ref_optimizer = reference(kind, K_STEPS + M_STEPS)
    assert max_error(model.state_dict(), ref_model.state_dict(), kind) <= 1e-12
    assert max_error(optimizer.state_dict(), ref_optimizer.state_dict(), kind) <= 1e-12


def test_report_largest_errors(checkpoint_dir):
    """Prints the largest parameter and state error per optimizer over every
    phase (run with -s to see them)."""
    worst = {}
    for path in glob.glob(os.path.join(checkpoint_dir, "errors-*.json")):
        with open(path) as f:
            e = json.load(f)
        w = worst.setdefault(e["optimizer"], {"param": 0.0, "state": 0.0, "checks": 0})
        w["param"], w["state"] = max(w["param"], e["param"]), max(w["state"], e["state"])
        w["checks"] += 1
    for kind, w in sorted(worst.items()):
        print(f"{kind}: {w['checks']} checks, largest parameter error {w['param']:.3g}, "
              f"largest state error {w['state']:.3g}")
    assert set(worst) == set(OPTIMIZERS), worst
