"""The phases of test_checkpoint.py, test_optimizer_state.py and test_pretrained.py, run once per
session, side by side.

Each file keeps its own table PHASES = {phase: (world, group, cases)} in the order its phases
must run (each loads what the ones before it saved, in its own folder). Their phases at the
same (world, group) whose orders allow it share one launch (both case modules in it, each
with its folder), which saves five launches of the fourteen; a phase that kills its ranks
(killed_save) keeps a launch of its own. Each phase test then reads its phase's result.
"""
import functools
import tempfile
from typing import Dict, Tuple, Union

from tests.distributed.harness import Results, launch_modules, scratch_dir

CHECKPOINT = "tests.distributed.cases_checkpoint"
OPTIMIZER_STATE = "tests.distributed.cases_optimizer_state"
PRETRAINED = "tests.distributed.cases_pretrained"
# Where each case module saves and loads (a folder per module: their file names overlap).
FOLDER_VARIABLE = {CHECKPOINT: "SHARDTORCH_CKPT_DIR", OPTIMIZER_STATE: "SHARDTORCH_OPTIM_STATE_DIR",
                   PRETRAINED: "SHARDTORCH_PRETRAINED_DIR"}

# The launches in order: ((module, phase), ...) each, all of one (world, group). Either file's
# phases appear in that file's order (checked by run_all).
LAUNCHES = [
    ((CHECKPOINT, "size1"), (OPTIMIZER_STATE, "size1")),
    ((CHECKPOINT, "killed_save"),),
    ((OPTIMIZER_STATE, "killed_save"),),
    ((CHECKPOINT, "size2"), (OPTIMIZER_STATE, "size2_from1"), (PRETRAINED, "save2")),
    ((CHECKPOINT, "size4"), (OPTIMIZER_STATE, "size4_from2"), (PRETRAINED, "load4")),
    ((CHECKPOINT, "2d"), (OPTIMIZER_STATE, "2x2_from4")),
    ((CHECKPOINT, "size2_from4"),),
    ((OPTIMIZER_STATE, "size3_from2x2"), (PRETRAINED, "load3")),
    ((CHECKPOINT, "size1_from4"), (OPTIMIZER_STATE, "size1_from3")),
]

Outcome = Union[Results, RuntimeError]  # a phase's {case: error or None}, or its launch's crash


def _tables():
    from tests.distributed import test_checkpoint, test_optimizer_state, test_pretrained
    return {CHECKPOINT: test_checkpoint.PHASES, OPTIMIZER_STATE: test_optimizer_state.PHASES,
            PRETRAINED: test_pretrained.PHASES}


@functools.lru_cache(maxsize=None)
def run_all() -> Tuple[Dict[Tuple[str, str], Outcome], Dict[str, str]]:
    """({(module, phase): outcome}, {module: its folder}): every phase of both tables, run once."""
    tables = _tables()
    for module, table in tables.items():
        order = [phase for launch in LAUNCHES for m, phase in launch if m == module]
        assert order == list(table), f"{module}: LAUNCHES runs its phases as {order}, its PHASES as {list(table)}"
    folders = {module: tempfile.mkdtemp(prefix=module.rsplit(".", 1)[1] + "-", dir=scratch_dir()) for module in tables}
    env = {FOLDER_VARIABLE[module]: folder for module, folder in folders.items()}
    outcomes: Dict[Tuple[str, str], Outcome] = {}
    for launch in LAUNCHES:
        (world, group), = {tables[module][phase][:2] for module, phase in launch}
        requests = {module: tables[module][phase][2] for module, phase in launch}
        try:
            results = launch_modules(requests, world, group, env=env)
        except RuntimeError as e:  # a rank crashed (killed_save expects it): the phases of the launch fail alike
            results = {module: e for module in requests}
        for module, phase in launch:
            outcomes[(module, phase)] = results[module]
    return outcomes, folders


def outcome(module: str, phase: str) -> Outcome:
    return run_all()[0][(module, phase)]


def folder(module: str) -> str:
    return run_all()[1][module]


def check(module: str, phase: str) -> None:
    """Asserts that ``phase`` of ``module`` passed: no rank crashed, no case failed, and every case
    its PHASES lists ran. A phase named killed_save is the exception: its ranks die midway through a
    save (os._exit(17)), and that exit is what it must show."""
    results = outcome(module, phase)
    if phase == "killed_save":
        assert isinstance(results, RuntimeError) and "exited with 17" in str(results), results
        return
    if isinstance(results, RuntimeError):  # a rank crashed
        raise results
    failed = {case: error for case, error in results.items() if error is not None}
    assert not failed, "\n\n".join(f"{case}:\n{error}" for case, error in failed.items())
    assert set(results) == set(_tables()[module][phase][2]), results
