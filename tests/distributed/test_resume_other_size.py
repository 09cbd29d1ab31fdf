"""The main job (examples/python/train_classifier.py) resumes at another size.

A run on 4 ranks (2 data-parallel x 2 tensor-parallel, float64) saves at step
3, inside a 6-step learning-rate warm-up. Resumed on 2 ranks (1 x 2) and on 3 ranks
(tensor-parallel 3) and saved again at once, the checkpoint comes back
bit-for-bit (model, optimizer state, schedule): nothing is lost or changed by
resharding. Continued to step 6 on 1, 2 and 3 ranks (one data-parallel
replica each, so the same data), the final parameters agree within 1e-12; the
1-rank run is the unsharded model continuing from the same checkpoint."""
import os

import pytest
import torch

from tests.distributed.harness import REPO, run_script

PROGRAM = os.path.join(REPO, "examples", "python", "train_classifier.py")
SMALL = ["--classes", "3001", "--features", "64", "--batch-size", "16", "--active-classes", "8",
         "--image-size", "8", "--no-progress", "--no-compare", "--lr", "0.1", "--dtype", "float64",
         "--warmup-steps", "6", "--layout", "2d"]


def _run(world, group, *args):
    results = run_script(PROGRAM, world, [*SMALL, "--group-size", group, *map(str, args)], timeout=600)
    for code, output in results:
        assert code == 0, output[-4000:]
    return results[0][1]


@pytest.fixture(scope="module")
def saved_on_2x2(tmp_path_factory):
    directory = tmp_path_factory.mktemp("resume")
    _run(4, 2, "--steps", "3", "--save", directory / "a")
    return directory


def _load(directory, name):
    return torch.load(os.path.join(directory, "step-3", name), weights_only=True)


@pytest.mark.parametrize("world,group", [(2, 2), (3, 3)])
def test_resharded_checkpoint_saves_back_identical(saved_on_2x2, world, group):
    again = saved_on_2x2 / f"again-{world}"
    _run(world, group, "--steps", "3", "--resume", saved_on_2x2 / "a", "--save", again)
    for name in ("backbone.pt", "head.pt"):
        original, back = _load(saved_on_2x2 / "a", name), _load(again, name)
        assert original.keys() == back.keys()
        for key in original:
            assert torch.equal(original[key], back[key]), f"{name} {key} changed by resuming at {world} ranks"
    original, back = _load(saved_on_2x2 / "a", "optimizer.pt"), _load(again, "optimizer.pt")
    assert original["param_groups"] == back["param_groups"]
    assert original["state"].keys() == back["state"].keys() and len(original["state"]) > 0
    for index, values in original["state"].items():
        for key, value in values.items():
            assert torch.equal(value, back["state"][index][key]), (index, key)
    # Momentum exists (3 steps were taken) and the warm-up is mid-way.
    assert all("momentum_buffer" in v for v in original["state"].values())
    trainer, trainer_back = _load(saved_on_2x2 / "a", "trainer.pt"), _load(again, "trainer.pt")
    assert trainer["scheduler"] == trainer_back["scheduler"] and trainer["scheduler"]["last_epoch"] == 3
    assert original["param_groups"][0]["lr"] == pytest.approx(0.1 * 4 / 6)


def test_continues_alike_at_1_2_and_3_ranks(saved_on_2x2):
    finals = {}
    for world in (1, 2, 3):
        dump = saved_on_2x2 / f"final-{world}.pt"
        _run(world, world, "--steps", "6", "--resume", saved_on_2x2 / "a", "--dump-params", dump)
        finals[world] = torch.load(dump, weights_only=True)
    reference = finals[1]  # tensor-parallel size 1: the unsharded model
    worst = 0.0
    for world in (2, 3):
        for part, state in reference.items():
            for key, value in state.items():
                other = finals[world][part][key]
                assert other.shape == value.shape, (world, part, key)
                if value.is_floating_point():
                    worst = max(worst, (other - value).abs().max().item())
                else:
                    assert torch.equal(other, value), (world, part, key)
    print(f"largest parameter difference after resuming at 2 and 3 ranks vs 1: {worst:.3g}")
    assert worst <= 1e-12
    # And training moved them: the checkpoint is not what came out.
    start = _load(saved_on_2x2 / "a", "head.pt")
    assert not torch.equal(start["weight"], reference["head"]["weight"])


def test_zero_checkpoint_resumes_at_another_layout(tmp_path):
    """--zero (ZeroRedundancyOptimizer over the data-parallel group): saved on
    2 x 2, resumed on 4 ranks of 4 x 1 (ZeRO over 4) and on 2 ranks without
    --zero, and saved again at once: the same optimizer state, bit for bit."""
    _run(4, 2, "--steps", "3", "--zero", "--save", tmp_path / "a")
    _run(4, 1, "--steps", "3", "--zero", "--resume", tmp_path / "a", "--save", tmp_path / "b")
    _run(2, 2, "--steps", "3", "--resume", tmp_path / "b", "--save", tmp_path / "c")
    original = _load(tmp_path / "a", "optimizer.pt")
    assert len(original["state"]) > 0 and all("momentum_buffer" in v for v in original["state"].values())
    for again in ("b", "c"):
        back = _load(tmp_path / again, "optimizer.pt")
        assert original["param_groups"] == back["param_groups"], again
        assert original["state"].keys() == back["state"].keys(), again
        for index, values in original["state"].items():
            for key, value in values.items():
                assert torch.equal(value, back["state"][index][key]), (again, index, key)
