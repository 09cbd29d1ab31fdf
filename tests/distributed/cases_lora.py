"""LoRA with peft on a parallelized model (shardtorch/nn/whole_model/lora.py), on real ranks, against
the same peft workflow on the unsharded model in float64: a tiny Llama with grouped key/value heads
(4 query heads over 2 key/value heads: split at 2 ranks, replicated at 3), a tiny GPT-2 (fused
c_attn Conv1D, 10 heads: 5/5 and 4/3/3) and a tiny Phi-3 (fused qkv_proj and gate_up_proj). Both orders (peft then parallelize; parallelize or
from_pretrained then peft): loss, logits, adapter gradients and the adapters after AdamW steps within
1e-10 relative; the adapter saved by ts.nn.save_adapter loads on the unsharded model and gives the
parallel model's logits; merge_and_unload gives the unsharded merged model; what cannot be split
is refused on every rank; docs/fine-tuning.md's LoRA block runs as written."""
import os
import re
import shutil
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardtorch as ts
from shardtorch.nn.whole_model.lora_layers import ColumnLora, RowLora
from tests.distributed import parallelize_models as models
from tests.distributed.zoo_models import ZOO
from tests.launcher import REPO
from tests.reference import expect_error

peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

F64 = torch.float64
EXACT = 1e-10
MODELS = {
    "llama": (lambda: models.llama(kv_heads=2, heads=4),
              ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "gpt2": (models.gpt2, ["c_attn", "c_proj", "c_fc"]),
    # Fused q/k/v of unequal parts and fused [gate | up]; 2 key/value heads: at 3 ranks the key/value rows
    # lie on the first ranks and every forward sums them whole (ColumnProjection's gathered parts).
    "phi3": (lambda: ZOO["phi3_kv2"][0](), ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
}


def _base(name):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MODELS[name][0]().to(F64)


def _config(name):
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=MODELS[name][1],
                      fan_in_fan_out=name == "gpt2")  # GPT-2's Conv1D stores its weight [in, out]


def _with_lora(model, config):
    torch.manual_seed(1)  # peft draws lora_A: the same draws on every rank and in the reference
    return get_peft_model(model, config)


def _nonzero_b(peft_model):
    """Whole lora_B (peft starts it at zero) drawn under a seed, so that the adapters act from the first step."""
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for key, param in peft_model.named_parameters():
            if "lora_B" in key:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return peft_model


def _ids(seed):
    return torch.randint(3, models.VOCAB, (2, models.SEQ), generator=torch.Generator().manual_seed(seed))


def _relative(actual, expected):
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-300)).item()


def _assert_exact(actual, expected, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    error = _relative(actual.double(), expected.double())
    assert error <= EXACT, f"{what}: relative error {error:.3g} > {EXACT:g}"


def _whole_adapter(model, grads=False):
    """The adapter tensors (or their gradients) of a parallel PeftModel, whole, by its shard facts."""
    state = model.state_dict()
    if grads:
        params = dict(model.named_parameters())
        state = {k: params[k].grad if k in params and params[k].grad is not None else v for k, v in state.items()}
    return {k: v for k, v in ts.collect_state_dict(model, state).items() if "lora_" in k}


def _adapter(model, grads=False):
    return {k: (p.grad if grads else p.detach()) for k, p in model.named_parameters() if "lora_" in k}


def _assert_adapters_equal(parallel, reference, what, grads=False):
    whole, expected = _whole_adapter(parallel, grads), _adapter(reference, grads)
    assert set(whole) == set(expected), f"{what}: keys differ: {sorted(set(whole) ^ set(expected))}"
    for key in expected:
        _assert_exact(whole[key], expected[key], f"{what} {'gradient of ' if grads else ''}{key}")


def _causal_loss(logits, ids):
    # Written out in float64: transformers' own loss widens float64 logits no further than float32.
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _step(model, optimizer, seed, reference):
    """One AdamW step: the parallel model's own loss (labels=, from the vocabulary shards), the
    reference's written out."""
    optimizer.zero_grad()
    ids = _ids(seed)
    loss = _causal_loss(model(input_ids=ids).logits, ids) if reference else model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    return loss.detach()


def _train_alike(parallel, reference, what, steps=2):
    """AdamW steps on the adapters of both models: the losses, the last step's adapter gradients and the
    adapters after each step agree."""
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
                  for m in (parallel, reference)]
    for step in range(steps):
        losses = [_step(m, o, 10 + step, m is reference) for m, o in zip((parallel, reference), optimizers)]
        _assert_exact(losses[0], losses[1], f"{what}: loss at step {step}")
    _assert_adapters_equal(parallel, reference, f"{what} after {steps} steps", grads=True)
    _assert_adapters_equal(parallel, reference, f"{what} after {steps} steps")


def _assert_split(peft_model, name):
    """Every targeted projection is a sharded LoRA layer around a split base, its factor split as the
    base: lora_B by the column base's output rows, lora_A by the row base's input features (a
    replicated key/value projection keeps both whole)."""
    wrapped = [m for m in peft_model.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    assert len(wrapped) == {"llama": 14, "gpt2": 8, "phi3": 8}[name], [type(m).__name__ for m in wrapped]
    for layer in wrapped:
        assert isinstance(layer, (ColumnLora, RowLora)), f"{type(layer).__name__} left whole"
        base = layer.base_layer
        if isinstance(layer, RowLora):
            held, whole = layer.lora_A["default"].weight.shape[1], base.full_in_features
            assert held == base.in_features < whole, f"{base}: lora_A holds {held} of {whole} inputs"
        elif type(base).__name__ == "ColumnProjection":
            held, whole = layer.lora_B["default"].weight.shape[0], base.full_out_features
            assert held == base.weight.shape[1 if base.transposed else 0] < whole, (
                f"{base}: lora_B holds {held} of {whole} outputs")


def _logits(model, seed=20):
    with torch.no_grad():
        return model(input_ids=_ids(seed)).logits


def _shared_dir():
    path = [tempfile.mkdtemp(prefix="shardtorch_lora_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def _remove(path):
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def case_peft_then_parallelize_trains_as_unsharded():
    """get_peft_model on the whole model, then ts.nn.parallelize(peft_model) (the proof runs on it and
    passes): the base projections and their adapters split, the unsharded model's logits, loss,
    adapter gradients and AdamW steps."""
    for name in MODELS:
        reference = _nonzero_b(_with_lora(_base(name), _config(name)))
        parallel = _nonzero_b(_with_lora(_base(name), _config(name)))
        assert ts.nn.parallelize(parallel) is parallel
        _assert_split(parallel, name)
        _assert_exact(_logits(parallel), _logits(reference), f"{name}: logits")
        _train_alike(parallel, reference, f"{name}, peft then parallelize")


def case_parallelize_then_peft_trains_as_unsharded():
    """ts.nn.parallelize, then get_peft_model with ts.nn.lora_config: peft draws the adapters as on the
    unsharded model (each rank keeps its slices), and training matches (from the second step on, the
    adapters change the forward)."""
    for name in MODELS:
        reference = _with_lora(_base(name), _config(name))
        parallel = _with_lora(ts.nn.parallelize(_base(name)), ts.nn.lora_config(_config(name)))
        _assert_split(parallel, name)
        _assert_adapters_equal(parallel, reference, f"{name}: adapters as drawn")
        _train_alike(parallel, reference, f"{name}, parallelize then peft", steps=3)


def case_from_pretrained_then_peft_trains_as_unsharded():
    """A model no rank held whole (ts.nn.from_pretrained), then get_peft_model: as the unsharded one."""
    path = _shared_dir()
    if dist.get_rank() == 0:
        _base("llama").save_pretrained(path)
    dist.barrier()
    from transformers import LlamaForCausalLM
    parallel = _with_lora(ts.nn.from_pretrained(path), ts.nn.lora_config(_config("llama")))
    # transformers' own loading: its rotary tables are computed in the loaded dtype, as from_pretrained's
    reference = _with_lora(LlamaForCausalLM.from_pretrained(path, dtype=F64), _config("llama"))
    _assert_split(parallel, "llama")
    _train_alike(parallel, reference, "from_pretrained then peft", steps=3)
    _remove(path)


def case_saved_adapter_loads_on_the_unsharded_model():
    """ts.nn.save_adapter (every rank; rank 0 writes), and peft's save_pretrained of a PeftModel that
    parallelize split, write peft's plain adapter: whole tensors under
    peft's names, equal to the unsharded model's trained adapter, and PeftModel.from_pretrained on the
    unsharded model gives the parallel model's logits."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file
    for name in MODELS:
        reference = _nonzero_b(_with_lora(_base(name), _config(name)))
        parallel = ts.nn.parallelize(_nonzero_b(_with_lora(_base(name), _config(name))))
        _train_alike(parallel, reference, f"{name} before saving", steps=1)
        path = _shared_dir()
        if name == list(MODELS)[0]:
            ts.nn.save_adapter(parallel, path)
        else:  # peft's own method of a PeftModel parallelize split goes through save_adapter
            parallel.save_pretrained(path)
        saved = load_file(os.path.join(path, "adapter_model.safetensors"))
        expected = get_peft_model_state_dict(reference)
        assert set(saved) == set(expected), f"{name}: saved keys differ: {sorted(set(saved) ^ set(expected))}"
        for key in expected:
            _assert_exact(saved[key], expected[key], f"{name}: saved {key}")
        loaded = PeftModel.from_pretrained(_base(name), path)
        _assert_exact(_logits(loaded), _logits(parallel), f"{name}: logits of the saved adapter on the unsharded model")
        _remove(path)


def case_merge_and_unload_gives_the_unsharded_merged_model():
    """merge_and_unload of the parallel PeftModel is the parallelized model with the adapters merged
    into its shards: its collected state dict and logits are the unsharded merged model's."""
    for name in MODELS:
        reference = _nonzero_b(_with_lora(_base(name), _config(name))).merge_and_unload()
        parallel = ts.nn.parallelize(_nonzero_b(_with_lora(_base(name), _config(name)))).merge_and_unload()
        assert not any(isinstance(m, peft.tuners.lora.LoraLayer) for m in parallel.modules())
        full, expected = ts.collect_state_dict(parallel, parallel.state_dict()), reference.state_dict()
        assert set(full) == set(expected), f"{name}: keys differ: {sorted(set(full) ^ set(expected))}"
        for key in expected:
            _assert_exact(full[key], expected[key], f"{name}: merged {key}")
        _assert_exact(_logits(parallel), _logits(reference), f"{name}: merged logits")


def case_adapters_that_cannot_be_split_are_refused_on_every_rank():
    """DoRA, lora_bias, and LoRA on the vocabulary-parallel head: ValueError on every rank, naming the fix."""
    for refused in (dict(use_dora=True), dict(lora_bias=True)):
        config = LoraConfig(r=4, target_modules=["q_proj"], **refused)
        expect_error(lambda: get_peft_model(ts.nn.parallelize(_base("llama")), ts.nn.lora_config(config)),
                     "takes plain LoRA", "change the LoraConfig", exception=ValueError)
    head = LoraConfig(r=4, target_modules=["lm_head"])
    expect_error(lambda: get_peft_model(ts.nn.parallelize(_base("llama")), ts.nn.lora_config(head)),
                 "takes no LoRA adapter", "out of target_modules", exception=ValueError)
    whole = _with_lora(_base("llama"), LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    expect_error(lambda: ts.nn.parallelize(whole), "'lm_head'", "cannot follow", "'replicate'", exception=ValueError)


def case_sequence_parallel_peft_model_trains_as_unsharded():
    """parallelize(peft_model, sequence_parallel=True): the row projections reduce-scatter base and
    adapter together, and training matches the unsharded peft model."""
    reference = _nonzero_b(_with_lora(_base("llama"), _config("llama")))
    parallel = ts.nn.parallelize(_nonzero_b(_with_lora(_base("llama"), _config("llama"))), sequence_parallel=True)
    _assert_split(parallel, "llama")
    _train_alike(parallel, reference, "llama, sequence parallel")


def _doc_block(section):
    with open(os.path.join(REPO, "docs", "fine-tuning.md")) as f:
        found = re.search(rf"^## {section}\n+```python\n(.*?)^```", f.read(), re.S | re.M)
    assert found, f"docs/fine-tuning.md has no python block under '## {section}'"
    return found.group(1)


def case_the_lora_block_of_fine_tuning_md_runs_as_written():
    """The block, run on a tiny Llama from a directory all ranks share: the adapter it saves, loaded and
    merged on the unsharded model, gives the logits of the parallel model it merged."""
    path, here = _shared_dir(), os.getcwd()
    namespace = {"ts": ts, "torch": torch, "model": _base("llama"), "ids": _ids(30)}
    os.chdir(path)
    try:
        exec(_doc_block("LoRA"), namespace)
    finally:
        os.chdir(here)
    loaded = PeftModel.from_pretrained(_base("llama"), os.path.join(path, "adapter")).merge_and_unload()
    _assert_exact(_logits(namespace["merged"]), _logits(loaded), "merged logits against the saved adapter merged")
    _remove(path)
