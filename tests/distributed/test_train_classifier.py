"""The main job (examples/python/train_classifier.py) at small sizes on 2 CPU
ranks: it learns, a resumed run continues exactly (with class sampling), --help documents every flag,
its held-out accuracy is torch.topk's on the gathered logits; at 2 x 2, --fsdp
trains like DDP."""
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.distributed.harness import REPO, run_script

PROGRAM = os.path.join(REPO, "examples", "python", "train_classifier.py")
SMALL = ["--classes", "3001", "--features", "64", "--batch-size", "16", "--active-classes", "8",
         "--image-size", "8", "--no-progress", "--no-compare", "--lr", "0.1"]


def _load_program():
    spec = importlib.util.spec_from_file_location("train_classifier", PROGRAM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train(tmp_path, name, *args):
    log = tmp_path / f"{name}.json"
    results = run_script(PROGRAM, 2, [*SMALL, "--log-json", log, *args], timeout=600)
    for code, output in results:
        assert code == 0, output[-4000:]
    with open(log) as f:
        return {int(k): v for k, v in json.load(f).items()}, results[0][1]


def test_help_documents_every_flag():
    out = subprocess.run([sys.executable, PROGRAM, "--help"], capture_output=True, text=True, check=True).stdout
    parser = _load_program().build_parser()
    for action in parser._actions:
        for flag in action.option_strings:
            assert flag in out, f"{flag} missing from --help"
        assert action.help, f"{action.option_strings} has no help text"


def test_sample_rate_needs_a_margin_loss_and_a_rate_in_range(capsys):
    program = _load_program()
    for argv, fragment in ((["--sample-rate", "0.5"], "use it with --loss arcface or cosface"),
                           (["--loss", "arcface", "--sample-rate", "0"], "--sample-rate must be in (0, 1], got 0.0")):
        with pytest.raises(SystemExit):
            program.parse_args(argv)
        assert fragment in capsys.readouterr().err
    assert program.parse_args(["--loss", "cosface", "--sample-rate", "0.1"]).sample_rate == 0.1


@pytest.mark.parametrize("extra", [[], ["--fused-loss"], ["--layout", "2d", "--group-size", "1"],
                                   ["--loss", "arcface", "--sample-rate", "0.3"]])
def test_loss_decreases_and_memory_summary_is_printed(tmp_path, extra):
    losses, output = _train(tmp_path, "run", "--steps", "24", *extra)
    first, last = sum(losses[s] for s in range(4)) / 4, sum(losses[s] for s in range(20, 24)) / 4
    assert last < 0.8 * first, losses
    assert "[rank 0] parameters" in output and "peak training memory" in output, output[-2000:]


@pytest.mark.parametrize("loss", [["--loss", "arcface", "--sample-rate", "0.4"]])
def test_resume_continues_exactly(tmp_path, loss):
    """With class sampling, whose random draws must resume too. The plain loss
    resumed at the same size is test_elastic_restart.py's (bitwise parameters),
    and at other sizes test_resume_other_size.py's."""
    checkpoint = tmp_path / "ckpt"
    # The straight run saves at step 3 on its way (as a run that stopped there would have).
    straight, _ = _train(tmp_path, "straight", "--steps", "6", "--save", checkpoint, "--save-every", "3", *loss)
    resumed, _ = _train(tmp_path, "resumed", "--steps", "6", "--resume", checkpoint / "step-3", *loss)
    assert sorted(resumed) == [3, 4, 5]
    for step in (3, 4, 5):
        assert resumed[step] == pytest.approx(straight[step], rel=1e-6, abs=1e-7), (step, resumed, straight)


def test_fsdp_trains_like_ddp_at_2x2(tmp_path):
    """--fsdp (FSDP2 over the data-parallel dimension, shardtorch over the
    tensor-parallel one) against DDP at 2 x 2, hybrid layout with the fused
    loss, float64: the same parameters after 3 steps (BatchNorm statistics
    aside: DDP broadcasts rank 0's, FSDP2 keeps each rank's)."""
    finals = {}
    for name, extra in (("ddp", []), ("fsdp", ["--fsdp"])):
        dump = tmp_path / f"{name}.pt"
        results = run_script(PROGRAM, 4, [*SMALL, "--group-size", "2", "--layout", "hybrid", "--fused-loss",
                                          "--dtype", "float64", "--steps", "3", "--dump-params", dump, *extra],
                             timeout=600)
        for code, output in results:
            assert code == 0, output[-4000:]
        assert "[rank 0] model state" in results[0][1], results[0][1][-2000:]
        finals[name] = torch.load(dump, weights_only=True)
    worst = 0.0
    for part, state in finals["ddp"].items():
        for key, value in state.items():
            if "running_" in key or "num_batches" in key:
                continue
            other = finals["fsdp"][part][key]
            assert type(other) is torch.Tensor and other.shape == value.shape, (part, key)
            worst = max(worst, ((other - value).abs().max() / value.abs().max().clamp_min(1e-30)).item())
    print(f"largest relative parameter difference, --fsdp vs DDP at 2 x 2: {worst:.3g}")
    assert worst <= 1e-9, worst


def test_eval_and_data_flags_are_checked(capsys):
    program = _load_program()
    for argv, fragment in ((["--eval-every", "-1"], "--eval-every must be 0 or a positive number of steps, got -1"),
                           (["--eval-batch-size", "0"], "--eval-batch-size must be a positive number, got 0"),
                           (["--active-classes", "0"], "--active-classes must be a positive number, got 0"),
                           (["--classes", "10", "--active-classes", "11"],
                            "--active-classes must be at most --classes=10, got 11")):
        with pytest.raises(SystemExit):
            program.parse_args(argv)
        assert fragment in capsys.readouterr().err


def test_heldout_accuracy_is_torch_topk_of_the_gathered_cosine_logits(tmp_path):
    """Without --active-classes the data has steps x global batch / 16
    distinct classes, spread over both shards; the evaluations come before the
    first step, every --eval-every steps and after the last; and the last one's
    top-1 / top-5 equal torch.topk of the full cosine logits of the dumped
    final model on the held-out batch, computed here in float64."""
    at = SMALL.index("--active-classes")
    small = SMALL[:at] + SMALL[at + 2:]
    dump = tmp_path / "final.pt"
    steps, batch, classes = 16, 16, 3001
    results = run_script(PROGRAM, 2, [*small, "--steps", str(steps), "--eval-every", "6", "--dtype", "float64",
                                      "--loss", "arcface", "--sample-rate", "0.5", "--margin-scale", "16", "--dump-params", dump],
                         timeout=600)
    for code, output in results:
        assert code == 0, output[-4000:]
    output = results[0][1]
    active = steps * 2 * batch // 16
    assert f"data: {active:,} distinct classes of {classes:,}" in output, output[-3000:]
    evals = re.findall(r"^eval after step (\d+): held-out top-1 ([0-9.]+) top-5 ([0-9.]+) \((\d+) samples\)$",
                       output, re.M)
    assert [int(s) for s, _, _, _ in evals] == [0, 6, 12, 16], output[-3000:]
    assert int(evals[-1][3]) == 2 * batch

    program = _load_program()
    data = program.SyntheticPatterns(classes, active, 8, seed=0)
    ids = data.class_ids
    assert len(set(ids.tolist())) == active and ids.min() >= 0 and ids.max() < classes
    assert (ids < (classes + 1) // 2).any() and (ids >= (classes + 1) // 2).any()  # both shards hold some
    # The hybrid layout gathers rank 0's held-out samples, then rank 1's.
    heldout = [data.heldout(replica, batch) for replica in (0, 1)]
    images = torch.cat([x for x, _ in heldout]).double()
    labels = torch.cat([y for _, y in heldout])
    assert set(labels.tolist()) <= set(ids.tolist())
    final = torch.load(dump, weights_only=True)
    backbone = program.SmallCNN(64).double()
    backbone.load_state_dict(final["backbone"])
    backbone.eval()
    with torch.no_grad():
        cosine = F.normalize(backbone(images), dim=-1) @ F.normalize(final["head"]["weight"], dim=-1).t()
    assert cosine.shape == (2 * batch, classes)
    hits = cosine.topk(5, dim=-1).indices == labels.unsqueeze(-1)
    top1, top5 = hits[:, 0].double().mean().item(), hits.any(-1).double().mean().item()
    assert (float(evals[-1][1]), float(evals[-1][2])) == (pytest.approx(top1, abs=5e-4), pytest.approx(top5, abs=5e-4))
    print(f"held-out after {steps} steps: top-1 {top1:.3f}, top-5 {top5:.3f} ({active} classes)")
