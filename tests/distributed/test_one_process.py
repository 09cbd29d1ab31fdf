"""``ts.tensor_parallel(model, devices)`` from this one process (no torchrun), on CPU devices, in
float64 against the unsharded model (GPT-2, a grouped-head Llama, BERT and a timm ViT, each on 2 and
on 3 devices): logits, loss, every gradient, the parameters after optimizer steps, generate's
tokens, state_dict / load_state_dict / save_pretrained, from_pretrained(devices=), peft, the Trainer,
and the faults (a rank that raises alone, a rank that exits, an exception on every rank, Ctrl-C,
close). A model's workers serve several checks; later models' workers fork from the fork servers
the first one started."""
import copy
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.nn.functional as F

import shardtorch as ts
from tests.distributed import one_process_models as faulty
from tests.distributed import parallelize_models as models
from tests.launcher import REPO

F64 = torch.float64
CPU2, CPU3 = ["cpu", "cpu"], ["cpu", "cpu", "cpu"]


def _close(actual, expected, what, tolerance=1e-10):
    actual, expected = actual.detach().to(F64), expected.detach().to(F64)
    scale = expected.abs().max().clamp_min(1.0)
    error = ((actual - expected).abs().max() / scale).item()
    assert error <= tolerance, f"{what}: {error:.3e} relative off the unsharded model's"


def _whole_state_close(model, reference, what, tolerance=1e-10):
    state = model.state_dict()
    expected = reference.state_dict()
    assert sorted(state) == sorted(expected), what
    for key, value in expected.items():
        _close(state[key], value, f"{what}: {key}", tolerance)


def _tokens(seed, batch=2, length=models.SEQ):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, models.VOCAB, (batch, length), generator=generator)


def _causal_loss(logits, ids):
    """The next-token loss written out: float64 log-softmax, mean over the predicted tokens."""
    logits = logits[:, :-1].reshape(-1, logits.shape[-1]).to(F64)
    return -logits.log_softmax(-1).gather(1, ids[:, 1:].reshape(-1, 1)).mean()


def _masked_loss(logits, labels):
    keep = labels.reshape(-1) != -100
    logits = logits.reshape(-1, logits.shape[-1])[keep].to(F64)
    return -logits.log_softmax(-1).gather(1, labels.reshape(-1)[keep].reshape(-1, 1)).mean()


def _train_and_compare(model, reference, batch, loss_of, what, steps=3):
    """Gradients (as an SGD step of rate 1: each parameter moves by exactly minus its gradient, read
    back whole through state_dict), the gradient norm over parameters() and AdamW steps, against
    the unsharded model."""
    loss = loss_of(model, batch)
    expected_loss = loss_of(reference, batch)
    _close(loss, expected_loss, f"{what}: loss")
    loss.backward()
    expected_loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), float("inf"))
    expected_norm = torch.nn.utils.clip_grad_norm_(list(reference.parameters()), float("inf"))
    _close(norm, expected_norm, f"{what}: gradient norm over parameters()")
    for optimizer in (torch.optim.SGD(model.parameters(), lr=1.0), torch.optim.SGD(reference.parameters(), lr=1.0)):
        optimizer.step()
    _whole_state_close(model, reference, f"{what}: parameters after a step of minus the gradient")
    adam = torch.optim.AdamW(model.parameters(), lr=1e-2)
    expected_adam = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(steps):
        for optimizer, net in ((adam, model), (expected_adam, reference)):
            optimizer.zero_grad()
            loss_of(net, batch).backward()
            optimizer.step()
    _whole_state_close(model, reference, f"{what}: parameters after {steps} AdamW steps", 1e-9)


def _build(factory, devices, **options):
    torch.manual_seed(0)
    reference = factory().to(F64)
    return ts.tensor_parallel(copy.deepcopy(reference), devices, **options), reference


def test_gpt2_trains_and_generates_as_unsharded_and_survives_an_error_on_every_rank():
    model, reference = _build(models.gpt2, CPU2)
    try:
        count = sum(p.numel() for p in reference.parameters())
        assert sum(p.numel() for p in model.parameters()) == count
        assert repr(model) == f"TensorParallelModel(GPT2LMHeadModel over ['cpu', 'cpu'], {count:,} parameters, ready)"
        ids = _tokens(1)
        model.eval(), reference.eval()
        with torch.no_grad():
            out = model(input_ids=ids, labels=ids)
            expected = reference(input_ids=ids).logits
        _close(out.logits, expected, "gpt2 logits (eval, no_grad)")
        _close(out.loss, _causal_loss(expected, ids), "gpt2 loss from labels=")
        with torch.no_grad():  # torch.compile runs the caller's forward as it is (its work is the ranks')
            _close(torch.compile(model)(input_ids=ids).logits, expected, "gpt2 logits under torch.compile")
        # Every rank raises the same error (a sequence longer than the 16 positions: after the vocabulary-
        # parallel embedding's collective, at the position embedding): raised here, the model still works.
        with pytest.raises(IndexError, match="index out of range"):
            model(input_ids=_tokens(1, length=20))
        assert model._pool.broken is None
        tokens = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(tokens, reference.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0))
        model.train(), reference.train()

        def loss_of(net, batch):  # the loss the model computes from labels= against the written-out one
            if net is model:
                return net(input_ids=batch, labels=batch).loss
            return _causal_loss(net(input_ids=batch).logits, batch)
        _train_and_compare(model, reference, _tokens(2), loss_of, "gpt2")
        with pytest.raises(TypeError, match="does not pickle or copy"):
            copy.deepcopy(model)
        with pytest.raises(RuntimeError, match="live on its devices"):
            model.half()
    finally:
        model.close()
    assert all(p.poll() is not None for p in model._pool.processes), "close() left a worker running"
    with pytest.raises(ts.one_process.BrokenModelError, match="closed"):
        model(input_ids=ids)


def test_llama_grouped_heads_on_three_devices_trains_and_generates_as_unsharded():
    # 2 key/value heads for 8 query heads over 3 ranks: 3,3,2 query heads, key/value heads replicated.
    model, reference = _build(lambda: models.llama(kv_heads=2, heads=8), CPU3)
    try:
        ids = _tokens(3)
        reference.eval()
        model.eval()
        # A decoding step by hand: the cache a forward returns stays on the ranks (each its heads), and
        # passing it back in gives each rank its own.
        with torch.no_grad():
            first, expected_first = model(input_ids=ids, use_cache=True), reference(input_ids=ids, use_cache=True)
            step = model(input_ids=ids[:, -1:], past_key_values=first.past_key_values, use_cache=True)
            expected = reference(input_ids=ids[:, -1:], past_key_values=expected_first.past_key_values, use_cache=True)
        _close(step.logits, expected.logits, "llama decoding step on the ranks' caches")
        tokens = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(tokens, reference.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0))
        # The loss from the caller's own code on the (lazy) whole logits: gradients through the logits.
        loss_of = lambda net, b: _causal_loss(net(input_ids=b).logits, b)  # noqa: E731
        _train_and_compare(model, reference, _tokens(4), loss_of, "llama kv=2")
        # Gradients accumulate over two backwards until zero_grad, as torch's do.
        for net in (model, reference):
            net.zero_grad()
            loss_of(net, _tokens(5)).backward()
            loss_of(net, _tokens(6)).backward()
            torch.optim.SGD(net.parameters(), lr=1.0).step()
        _whole_state_close(model, reference, "llama after a step of two accumulated gradients")
    finally:
        model.close()


def test_bert_on_three_devices_and_vit_on_two_train_as_unsharded():
    model, reference = _build(models.bert, CPU3)  # 5 heads: 2,2,1
    try:
        ids = _tokens(5)
        labels = ids.clone()
        labels[:, ::2] = -100
        _train_and_compare(model, reference, (ids, labels),
                           lambda net, b: _masked_loss(net(input_ids=b[0]).logits, b[1]), "bert")
    finally:
        model.close()
    model, reference = _build(models.vit, CPU2)
    try:
        generator = torch.Generator().manual_seed(6)
        images = torch.randn(2, 3, 16, 16, generator=generator, dtype=F64, requires_grad=True)
        target = torch.randint(0, 10, (2,), generator=generator)
        # An input that wants its gradient: it comes back from rank 0's backward.
        whole_images = images.detach().clone().requires_grad_(True)
        F.cross_entropy(model(images), target).backward()
        F.cross_entropy(reference(whole_images), target).backward()
        _close(images.grad, whole_images.grad, "vit input gradient")
        images = images.detach()
        _train_and_compare(model, reference, images, lambda net, b: F.cross_entropy(net(b), target), "vit")
    finally:
        model.close()


def test_state_dict_save_pretrained_ctrl_c_and_from_pretrained_on_devices(tmp_path):
    model, reference = _build(lambda: models.llama(kv_heads=2, heads=8), CPU2)
    try:
        # load_state_dict of the unsharded model's (other) weights, then save_pretrained.
        torch.manual_seed(11)
        other = models.llama(kv_heads=2, heads=8).to(F64)
        result = model.load_state_dict(other.state_dict())
        assert not result.missing_keys and not result.unexpected_keys
        _whole_state_close(model, other, "after load_state_dict", 0.0)
        model.save_pretrained(str(tmp_path / "saved"))
        # Ctrl-C during a long generate: every rank stops at the same token, the model still works.
        model.eval()
        other.eval()
        ids = _tokens(8, length=4)
        timer = threading.Timer(1.5, signal.raise_signal, (signal.SIGINT,))
        start = time.monotonic()
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            model.generate(ids, max_new_tokens=10_000, min_new_tokens=10_000, do_sample=False, pad_token_id=0)
        timer.join()
        assert time.monotonic() - start < 15
        assert model._pool.broken is None
        tokens = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(tokens, other.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0))
    finally:
        model.close()
    from transformers import AutoModelForCausalLM
    # The reference loads the same folder the same way (its rotary buffers are computed in float64 as
    # from_pretrained's are, where ``other`` computed them in float32 before .to(float64)).
    whole = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"), dtype=F64)
    _close(whole.model.embed_tokens.weight, other.model.embed_tokens.weight, "save_pretrained's embedding", 0.0)
    loaded = ts.nn.from_pretrained(str(tmp_path / "saved"), devices=CPU2, dtype=F64)
    try:
        ids = _tokens(7)
        with torch.no_grad():
            _close(loaded(input_ids=ids).logits, whole(input_ids=ids).logits, "from_pretrained(devices=)")
        assert loaded.config.num_key_value_heads == 2
    finally:
        loaded.close()


def test_a_rank_that_raises_alone_is_raised_here_and_stops_the_others():
    torch.manual_seed(0)
    # Split, so that rank 0 goes on to the row projection's all-reduce, which rank 1 never joins.
    model = ts.tensor_parallel(faulty.RaisesOnOneRank(rank=1).to(F64), CPU2, plan={"up": "column", "down": "row"})
    try:
        x = torch.randn(3, 8, dtype=F64)
        model(x)
        start = time.monotonic()
        with pytest.raises(ValueError, match="raised on purpose on one rank") as raised:
            model(x, armed=True)
        assert time.monotonic() - start < 15
        notes = "".join(getattr(raised.value, "__notes__", []))
        assert "rank 1 (cpu)" in notes and "must be built again" in notes, notes
        assert all(p.poll() is not None for p in model._pool.processes), "a worker outlived the fault"
        with pytest.raises(ts.one_process.BrokenModelError, match="built again"):
            model(x)
    finally:
        model.close()


def test_a_rank_that_exits_is_raised_here_within_seconds():
    torch.manual_seed(0)
    model = ts.tensor_parallel(faulty.ExitsOnOneRank(rank=1).to(F64), CPU2)
    try:
        start = time.monotonic()
        with pytest.raises(ts.one_process.BrokenModelError, match=r"rank 1 \(cpu\) exited \(code 7\)"):
            model(torch.randn(3, 8, dtype=F64), armed=True)
        assert time.monotonic() - start < 15
        assert all(p.poll() is not None for p in model._pool.processes)
    finally:
        model.close()


def test_bad_devices_are_refused_before_any_worker_starts():
    net = torch.nn.Linear(4, 4)
    for devices, message in ((["cpu", "cuda:0"], "mix kinds"), ([], "non-empty list"), ("cpu", "non-empty list"),
                             (["cuda"], "index|CUDA device")):
        with pytest.raises(ValueError, match=message):
            ts.tensor_parallel(net, devices)
    with pytest.raises(TypeError, match="group= is not an option"):
        ts.tensor_parallel(net, CPU2, group="tp")
    with pytest.raises(TypeError, match="not both"):
        ts.tensor_parallel(net, CPU2, device_ids=CPU2)


def test_a_script_run_with_python_and_a_model_class_written_in_it(tmp_path):
    """No torchrun, no ``if __name__ == "__main__"`` guard, the model's class defined in the script
    itself (as in a notebook cell): the workers get the class by value."""
    script = tmp_path / "notebook.py"
    script.write_text(textwrap.dedent("""
        import torch
        import shardtorch as ts

        class Mlp(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.up, self.down = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8)

            def forward(self, x):
                return self.down(torch.nn.functional.gelu(self.up(x)))

        torch.manual_seed(0)
        whole = Mlp().double()
        model = ts.tensor_parallel(Mlp().double(), device_ids=["cpu", "cpu"])  # tensor_parallel's name for it
        model.load_state_dict(whole.state_dict())
        x = torch.randn(4, 8, dtype=torch.float64)
        print("max error", (model(x) - whole(x)).abs().max().item())
    """))
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    error = float(done.stdout.strip().split()[-1])
    assert error <= 1e-12, done.stdout


def test_the_example_runs():
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, os.path.join(REPO, "examples", "python", "one_process.py"), "--steps", "2"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "reloaded model's tokens are the same: True" in done.stdout, done.stdout


def test_a_peft_lora_model_trains_only_its_adapters_and_saves_them(tmp_path):
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    reference = get_peft_model(models.gpt2().to(F64), LoraConfig(r=4, target_modules=["c_attn", "c_proj"],
                                                                 lora_dropout=0.0, init_lora_weights=False))
    model = ts.tensor_parallel(copy.deepcopy(reference), CPU2)
    try:
        def trainable(net):
            return [p for p in net.parameters() if p.requires_grad]
        # The frozen base stays frozen on the caller's side too.
        assert sum(p.numel() for p in trainable(model)) == sum(p.numel() for p in trainable(reference))
        assert sum(p.numel() for p in trainable(model)) < sum(p.numel() for p in model.parameters()) // 10
        adam, expected_adam = torch.optim.AdamW(trainable(model), lr=1e-2), torch.optim.AdamW(trainable(reference),
                                                                                               lr=1e-2)
        ids = _tokens(9)
        for _ in range(2):
            for optimizer, net in ((adam, model), (expected_adam, reference)):
                optimizer.zero_grad()
                _causal_loss(net(input_ids=ids).logits, ids).backward()
                optimizer.step()
        _whole_state_close(model, reference, "LoRA after 2 AdamW steps", 1e-9)
        model.save_pretrained(str(tmp_path / "adapter"))
        assert sorted(os.listdir(tmp_path / "adapter")) == ["README.md", "adapter_config.json",
                                                            "adapter_model.safetensors"]
    finally:
        model.close()


def test_hugging_face_trainer_trains_it_as_the_unsharded_model(tmp_path):
    """Trainer as its docs show it (no launcher): it leaves the placement alone (hf_device_map), keeps
    the dataset columns the forward names (its signature), exempts the same norm weights and biases
    from weight decay (the norms' holders are of their class), clips the exact gradient norm."""
    from transformers import Trainer, TrainingArguments
    model, reference = _build(models.gpt2, CPU2)
    try:
        generator = torch.Generator().manual_seed(0)
        data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, models.VOCAB, (8, models.SEQ),
                                                                          generator=generator)]

        def loss_fn(outputs, labels, num_items_in_batch=None):  # float64 throughout (transformers' is float32)
            return _causal_loss(outputs.logits, labels)
        for net in (reference, model):
            args = TrainingArguments(output_dir=str(tmp_path / type(net).__name__), per_device_train_batch_size=2,
                                     max_steps=3, learning_rate=1e-2, weight_decay=0.1, max_grad_norm=1.0,
                                     report_to=[], use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True)
            trainer = Trainer(model=net, args=args, train_dataset=data, compute_loss_func=loss_fn)
            decayed = {name.split(".", 2)[2] if name.startswith("shards.") else name
                       for name in trainer.get_decay_parameter_names(net)}
            if net is reference:  # (less lm_head.weight: the tied embedding's other name)
                expected_decayed = decayed & {name for name, _ in reference.named_parameters()}
            else:
                assert decayed == expected_decayed
            trainer.train()
        _whole_state_close(model, reference, "after 3 Trainer steps (AdamW, weight decay, clipping, schedule)")
    finally:
        model.close()


@pytest.mark.parametrize("factory, devices, step", [
    (models.gpt2, CPU3, "causal"), (lambda: models.llama(kv_heads=2, heads=8), CPU2, "causal"),
    (models.bert, CPU2, "masked"), (models.vit, CPU3, "image")], ids=["gpt2-3cpu", "llama-2cpu", "bert-2cpu", "vit-3cpu"])
def test_each_model_on_the_other_device_count(factory, devices, step):
    """The other device count of each model above (GPT-2 and the ViT on 3, Llama and BERT on 2):
    logits, loss, every gradient and AdamW steps against the unsharded model."""
    model, reference = _build(factory, devices)
    try:
        if step == "image":
            generator = torch.Generator().manual_seed(10)
            batch = torch.randn(2, 3, 16, 16, generator=generator, dtype=F64)
            target = torch.randint(0, 10, (2,), generator=generator)
            with torch.no_grad():
                _close(model(batch), reference(batch), "vit logits")
            _train_and_compare(model, reference, batch, lambda net, b: F.cross_entropy(net(b), target), "vit")
            return
        ids = _tokens(11)
        with torch.no_grad():
            _close(model(input_ids=ids).logits, reference(input_ids=ids).logits, f"{step} logits")
        if step == "causal":
            _train_and_compare(model, reference, ids, lambda net, b: _causal_loss(net(input_ids=b).logits, b), step)
        else:
            labels = ids.clone()
            labels[:, ::2] = -100
            _train_and_compare(model, reference, (ids, labels),
                               lambda net, b: _masked_loss(net(input_ids=b[0]).logits, b[1]), step)
    finally:
        model.close()
