"""The second main job (examples/python/train_lm.py) at a tiny size on 2 CPU
ranks, run as a user runs it: it learns, the held-out perplexity it prints is
exp of the held-out loss of its own final model computed here without
shardtorch, the fused loss and sequence parallelism train like the plain run,
and a resumed run continues exactly."""
import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.distributed.harness import REPO, run_script

PROGRAM = os.path.join(REPO, "examples", "python", "train_lm.py")
TINY = ["--layers", "2", "--width", "64", "--heads", "4", "--vocab", "512", "--seq-len", "32", "--batch-size", "4",
        "--corpus-bytes", "400000", "--eval-windows", "6", "--lr", "3e-3", "--warmup-steps", "2", "--no-progress",
        "--no-compare", "--dtype", "float64"]


def _load(name):
    path = os.path.join(REPO, "examples", "python", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One tokenizer for the module's runs (the first run trains it)."""
    return str(tmp_path_factory.mktemp("lm_cache"))


def _train(tmp_path, cache_dir, name, *args, world=2, compare=False):
    """(losses, held-out losses, rank 0's output, every rank's output). ``compare``: the run also
    measures the unsharded model, after its log and dump are written (it changes neither)."""
    log = tmp_path / f"{name}.json"
    tiny = [a for a in TINY if a != "--no-compare"] if compare else TINY
    results = run_script(PROGRAM, world, [*tiny, "--cache-dir", cache_dir, "--log-json", log, *map(str, args)],
                         timeout=600)
    for code, output in results:
        assert code == 0, output[-4000:]
    with open(log) as f:
        logged = json.load(f)
    return ({int(k): v for k, v in logged["train"].items()}, {int(k): v for k, v in logged["heldout"].items()},
            results[0][1], "".join(out for _, out in results))


def test_help_documents_every_flag():
    out = subprocess.run([sys.executable, PROGRAM, "--help"], capture_output=True, text=True, check=True).stdout
    parser = _load("train_lm").build_parser()
    for action in parser._actions:
        for flag in action.option_strings:
            assert flag in out, f"{flag} missing from --help"
        assert action.help, f"{action.option_strings} has no help text"


def test_flags_are_checked(capsys):
    program = _load("train_lm")
    for argv, fragment in ((["--width", "100", "--heads", "8"], "--width must be a multiple of --heads=8"),
                           (["--vocab", "100"], "--vocab must be at least 257"),
                           (["--fsdp"], "--fsdp shards over the data-parallel dimension"),
                           (["--eval-every", "-1"], "--eval-every must be 0 or a positive number of steps, got -1")):
        with pytest.raises(SystemExit):
            program.parse_args(argv)
        assert fragment in capsys.readouterr().err


def _heldout_loss_unsharded(state_dict, cache_dir):
    """The mean next-token loss of the held-out windows the program scores,
    by the unsharded GPT2LMHeadModel with the collected weights and a plain
    float64 cross-entropy written here."""
    corpus, program = _load("stdlib_corpus"), _load("train_lm")
    args = program.parse_args([*TINY, "--cache-dir", cache_dir])
    model = program.make_model(args, args.vocab)
    model.load_state_dict(state_dict, strict=True)
    model.eval()
    _, tokens = corpus.build(args.vocab, cache_dir, args.corpus_bytes, log=lambda _: None)
    windows = corpus.TokenBatches(corpus.load(tokens), args.seq_len, args.seed).heldout_windows(args.eval_windows)
    assert windows.shape == (6, 32)
    with torch.no_grad():
        logits = model(windows).logits.double()
    log_probs = logits[:, :-1].log_softmax(-1)
    return -log_probs.gather(-1, windows[:, 1:].unsqueeze(-1)).mean().item()


def test_loss_falls_and_perplexity_is_exp_of_the_heldout_loss(tmp_path, cache_dir):
    dump = tmp_path / "final.pt"
    steps = 16
    losses, heldout, output, _ = _train(tmp_path, cache_dir, "run", "--steps", steps, "--eval-every", 8,
                                     "--dump-params", dump)
    first, last = sum(losses[s] for s in range(3)) / 3, sum(losses[s] for s in range(steps - 3, steps)) / 3
    assert last < first - 0.5, losses  # from ln(512) = 6.24
    assert sorted(heldout) == [0, 8, 16] and heldout[16] < heldout[0] - 0.5, heldout
    printed = re.findall(r"^eval after step (\d+): held-out loss ([0-9.]+) perplexity ([0-9.]+)$", output, re.M)
    assert [int(s) for s, _, _ in printed] == [0, 8, 16], output[-3000:]

    expected = _heldout_loss_unsharded(torch.load(dump, weights_only=True), cache_dir)
    assert heldout[16] == pytest.approx(expected, rel=1e-10)
    _, loss, perplexity = printed[-1]
    assert float(loss) == pytest.approx(expected, abs=6e-5)
    assert float(perplexity) == pytest.approx(math.exp(expected), abs=6e-3)
    print(f"held-out after {steps} steps: loss {expected:.4f}, perplexity {math.exp(expected):.2f}")


def test_memory_report_per_rank(plain_run):
    """Each rank reports its parameters (half the unsharded model's, less the
    replicated position embedding and norms) and its peak against the
    unsharded model's, measured (by the plain run, which measures it last)."""
    output = plain_run[2]
    for rank in (0, 1):
        found = re.search(rf"^\[rank {rank}\] parameters +([0-9.]+) MiB \(unsharded +([0-9.]+) MiB, ([0-9.]+)x\); "
                          rf"peak training memory +([0-9.]+) MiB \(unsharded +([0-9.]+) MiB, ([0-9.]+)x\)$",
                          output, re.M)
        assert found, output[-3000:]
        assert 1.8 < float(found.group(3)) <= 2.0 and float(found.group(6)) > 1.2, found.group(0)


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, cache_dir):
    """(losses, held-out losses, every rank's output) of 4 plain steps, for the
    variant to match; it also measures the unsharded model for the memory report."""
    losses, heldout, _, every_rank = _train(tmp_path_factory.mktemp("plain"), cache_dir, "plain", "--steps", 4,
                                            "--eval-every", 0, compare=True)
    return losses, heldout, every_rank


# Both in one run: each changes where the work happens, so either one wrong would show.
@pytest.mark.parametrize("variant", [["--fused-loss", "--sequence-parallel"]])
def test_variant_trains_like_the_plain_run(tmp_path, cache_dir, plain_run, variant):
    """The fused loss (logits never formed) and sequence parallelism change
    where the work happens, not the result: the same losses in float64."""
    plain, plain_heldout, _ = plain_run
    other, other_heldout, _, _ = _train(tmp_path, cache_dir, "variant", "--steps", 4, "--eval-every", 0, *variant)
    assert sorted(other) == sorted(plain) == [0, 1, 2, 3]
    for step in plain:
        assert other[step] == pytest.approx(plain[step], rel=1e-10), (step, other, plain)
    assert sorted(other_heldout) == sorted(plain_heldout) == [0, 4]
    for step in plain_heldout:
        assert other_heldout[step] == pytest.approx(plain_heldout[step], rel=1e-10)


def test_resume_continues_exactly(tmp_path, cache_dir):
    """A run that saves at step 3 and goes on to 6, against a run resumed from
    that checkpoint: the same losses and the same final parameters (float64:
    the model, AdamW's moments and the schedule all restored)."""
    checkpoint = tmp_path / "ckpt"
    straight, _, _, _ = _train(tmp_path, cache_dir, "straight", "--steps", 6, "--eval-every", 0, "--save", checkpoint,
                            "--save-every", 3, "--dump-params", tmp_path / "straight.pt")
    resumed, _, _, _ = _train(tmp_path, cache_dir, "resumed", "--steps", 6, "--eval-every", 0, "--resume",
                           checkpoint / "step-3", "--dump-params", tmp_path / "resumed.pt")
    assert sorted(resumed) == [3, 4, 5]
    for step in (3, 4, 5):
        assert resumed[step] == pytest.approx(straight[step], rel=1e-12), (step, resumed, straight)
    before, after = torch.load(tmp_path / "straight.pt"), torch.load(tmp_path / "resumed.pt")
    assert before.keys() == after.keys()
    for key, value in before.items():
        torch.testing.assert_close(after[key], value, rtol=1e-12, atol=0, msg=key)


def test_save_pretrained_at_2_continues_at_3_as_at_2(tmp_path, cache_dir):
    """--save-pretrained after 3 steps at 2 ranks writes a Hugging Face checkpoint; starting from it
    with --from-pretrained at 3 ranks (heads split 2/1/1, the vocabulary unevenly) trains like at 2:
    the same losses (1e-12) and final parameters (1e-10) in float64, each run a fresh AdamW from those
    weights."""
    saved = tmp_path / "pretrained"
    _train(tmp_path, cache_dir, "first", "--steps", 3, "--eval-every", 0, "--save-pretrained", saved)
    assert (saved / "config.json").is_file() and (saved / "model.safetensors").is_file()
    runs = {}
    for world in (2, 3):
        losses, _, _, _ = _train(tmp_path, cache_dir, f"from{world}", "--steps", 3, "--eval-every", 0,
                                 "--from-pretrained", saved, "--dump-params", tmp_path / f"from{world}.pt",
                                 world=world)
        runs[world] = losses, torch.load(tmp_path / f"from{world}.pt", weights_only=True)
    for step in (0, 1, 2):
        assert runs[3][0][step] == pytest.approx(runs[2][0][step], rel=1e-12), (step, runs[3][0], runs[2][0])
    # 2 and 3 ranks sum in other orders, and AdamW divides each update by the root of its second moment, which
    # makes last-bit differences of a near-zero gradient differences of its update: within 1e-10 of each tensor's
    # scale (the other parallelize tests' bound; 2e-12 measured).
    for key, value in runs[2][1].items():
        error = (runs[3][1][key] - value).abs().max().item()
        assert error <= 1e-10 * value.abs().max().item(), (key, error)
    from transformers import GPT2LMHeadModel
    first = GPT2LMHeadModel.from_pretrained(saved)  # plain transformers reads what the ranks wrote
    assert first.config.n_layer == 2 and first.config.vocab_size == 512
