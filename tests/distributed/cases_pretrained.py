"""ts.nn.from_pretrained / from_config / save_pretrained and torch's DCP on real ranks (Gloo, CPU).

The phases (test_pretrained.py) run in order: at 2 ranks rank 0 writes float64 Hugging Face
checkpoints of the unsharded models (transformers' own save_pretrained), the ranks load them
and save them back (save_pretrained of the parallelized model) and through torch's
get_state_dict + dcp.save; at 4 and then 3 ranks they load both back. The reference is
always the unsharded model: transformers' from_pretrained in float64, the checkpoint's own
tensors (safetensors.torch.load_file), and the models' own initialisation under one seed."""
import json
import os
import resource
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardtorch as ts
from shardtorch.checkpoint.layout import model_layout
from tests.distributed import parallelize_models as models
from tests.reference import expect_error

F64 = torch.float64
HF = {"gpt2": models.gpt2, "llama": models.llama, "llama_kv1": lambda: models.llama(kv_heads=1), "bert": models.bert}


def _dir(*parts):
    return os.path.join(os.environ["SHARDTORCH_PRETRAINED_DIR"], *parts)


def _rank0(fn):
    if dist.get_rank() == 0:
        fn()
    dist.barrier()


def _reference(name):
    torch.manual_seed(0)
    return HF[name]().to(F64) if name in HF else models.vit().to(F64)


def _ids(seed=1):
    return torch.randint(0, models.VOCAB, (3, models.SEQ), generator=torch.Generator().manual_seed(seed))


def _outputs(model, name):
    """(logits whole, loss) of one batch, the loss by F.cross_entropy on float64 logits."""
    if name == "vit":
        images = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(2), dtype=F64)
        logits = model(images)
        return logits, F.cross_entropy(logits, torch.tensor([1, 7]))
    ids = _ids()
    logits = model(input_ids=ids).logits
    if ts.utils.get_parallel_dim(logits) == -1:
        logits = ts.distributed.gather_replicated(logits.detach(), -1, full_size=models.VOCAB)
    logits = logits.detach()
    if name == "bert":
        return logits, F.cross_entropy(logits.reshape(-1, models.VOCAB), ids.reshape(-1))
    shifted = F.pad(ids, (0, 1), value=-100)[..., 1:]
    return logits, F.cross_entropy(logits.reshape(-1, models.VOCAB), shifted.reshape(-1))


def _assert_within(actual, expected, rel, what):
    scale = expected.abs().max().clamp_min(1e-300)
    error = ((actual.double() - expected.double()).abs().max() / scale).item()
    assert error <= rel, f"{what}: relative error {error:.3g} > {rel:g}"


def _assert_state_equal(model, expected, what):
    full = ts.collect_state_dict(model, model.state_dict())
    assert set(full) == set(expected), f"{what}: keys {sorted(set(full) ^ set(expected))}"
    for key, value in expected.items():
        assert full[key].dtype == value.dtype and torch.equal(full[key], value), f"{what}: {key} differs"


def _load(name, **options):
    if name == "vit":
        return ts.nn.from_pretrained(lambda: models.vit(), _dir("vit"), **options)
    return ts.nn.from_pretrained(_dir(name), **options)


# ------------------------------------------------------------------ phase save2 (2 ranks)
def case_write_reference_checkpoints():
    """Rank 0 writes the unsharded models with transformers' own save_pretrained (float64; a
    bfloat16 Llama; a Llama in index-sharded files) and a timm ViT as model.safetensors."""
    def write():
        from safetensors.torch import save_file
        for name in HF:
            _reference(name).save_pretrained(_dir(name))
        save_file(_reference("vit").state_dict(), os.path.join(_make(_dir("vit")), "model.safetensors"))
        torch.manual_seed(3)
        models.llama().to(torch.bfloat16).save_pretrained(_dir("llama_bf16"))
        _reference("llama").save_pretrained(_dir("llama_index"), max_shard_size="40KB")
        assert os.path.isfile(_dir("llama_index", "model.safetensors.index.json"))
    _rank0(write)


def _make(path):
    os.makedirs(path, exist_ok=True)
    return path


def case_loaded_models_equal_the_unsharded_model():
    """Logits and loss of each loaded model within 1e-12 of transformers' (timm's) unsharded model in
    float64, every weight bitwise the checkpoint's, the model in eval mode as transformers returns it."""
    from safetensors.torch import load_file
    for name in ("gpt2", "llama", "llama_kv1", "bert", "vit", "llama_index"):
        if name == "vit":
            reference = _reference("vit")
            reference.load_state_dict(load_file(_dir("vit", "model.safetensors")))
            reference.eval()
        else:
            reference = type(_reference(name.replace("_index", ""))).from_pretrained(_dir(name))
        model = _load(name)
        assert not model.training, f"{name}: not in eval mode"
        _assert_state_equal(model, reference.state_dict(), f"{name} weights")
        with torch.no_grad():
            (logits, loss), (ref_logits, ref_loss) = _outputs(model, name), _outputs(reference, name)
        _assert_within(logits, ref_logits, 1e-12, f"{name} logits")
        _assert_within(loss, ref_loss, 1e-12, f"{name} loss")


def case_bfloat16_shards_are_the_checkpoint_slices():
    """Each rank's tensors are bitwise the checkpoint's slices in bfloat16 (mapped or read), and
    dtype=float32 gives exactly their conversion."""
    from safetensors.torch import load_file
    whole = load_file(_dir("llama_bf16", "model.safetensors"))
    for options in ({}, {"mmap": False}, {"dtype": torch.float32}):
        model = ts.nn.from_pretrained(_dir("llama_bf16"), **options)
        local = model.state_dict()
        layout = model_layout(model, local)
        expected_dtype = options.get("dtype", torch.bfloat16)
        for key, tensor in local.items():
            if key not in whole:
                continue
            entry = layout[key]
            expected = entry.take(whole[key], entry.group_rank) if entry.sharded else whole[key]
            assert tensor.dtype == expected_dtype, (options, key, tensor.dtype)
            assert torch.equal(tensor, expected.to(expected_dtype)), f"{options}: {key} is not its slice"


def case_fresh_models_draw_the_unsharded_models_slices():
    """from_config: every weight bitwise the unsharded model's under the same seed, and the generator
    left where the unsharded construction leaves it."""
    for name in ("gpt2", "llama", "llama_kv1", "bert", "vit"):
        torch.manual_seed(7)
        reference = HF[name]() if name in HF else models.vit()
        after_reference = torch.rand(4)
        torch.manual_seed(7)
        if name in HF:
            model = ts.nn.from_config(type(reference), reference.config)
        else:
            model = ts.nn.from_config(models.vit)
        assert torch.equal(torch.rand(4), after_reference), f"{name}: the generator ends elsewhere"
        _assert_state_equal(model, reference.state_dict(), f"fresh {name}")


class _TruncatedNormal(torch.nn.Module):
    """torch's trunc_normal_ (2.14) resamples until every value is in range: it needs the values."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 40)
        self.down = torch.nn.Linear(40, 16)
        torch.nn.init.trunc_normal_(self.up.weight, std=0.02)
        torch.nn.init.trunc_normal_(self.down.weight, std=0.02)


def case_fresh_init_that_reads_values_is_refused_and_loads_anyway():
    """from_config refuses an initialisation that reads the values it draws (named, every rank); the
    same model loads from a checkpoint (its values replace the init), and a missing weight of it is
    refused rather than drawn otherwise."""
    plan = {"up": "column", "down": "row"}
    expect_error(lambda: ts.nn.from_config(_TruncatedNormal, plan=plan), "reads the values")
    torch.manual_seed(11)
    reference = _TruncatedNormal()

    def write():
        from safetensors.torch import save_file
        save_file(reference.state_dict(), os.path.join(_make(_dir("trunc")), "model.safetensors"))
        tensors = dict(reference.state_dict())
        del tensors["up.weight"]
        save_file(tensors, os.path.join(_make(_dir("trunc_missing")), "model.safetensors"))
    _rank0(write)
    model = ts.nn.from_pretrained(_TruncatedNormal, _dir("trunc"), plan=plan)
    _assert_state_equal(model, reference.state_dict(), "trunc_normal_ model loaded")
    expect_error(lambda: ts.nn.from_pretrained(_TruncatedNormal, _dir("trunc_missing"), plan=plan),
                 "up.weight", "cannot run on the meta device")


class _Orthogonal(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 12)
        self.down = torch.nn.Linear(12, 8)
        torch.nn.init.orthogonal_(self.up.weight)


def case_fresh_init_refuses_what_it_cannot_draw_by_slices():
    """An orthogonal_ initialisation (a QR of a whole random matrix) of a sharded weight: refused by
    name on every rank, nothing drawn in its place."""
    plan = {"up": "column", "down": "row"}
    expect_error(lambda: ts.nn.from_config(_Orthogonal, plan=plan), "'up.weight'", "computed at construction")


def case_missing_weights_are_initialised_alike_and_named():
    """A checkpoint without one weight: a warning names it and every rank holds the same draw (its
    slices of one tensor); the loaded ones stay the checkpoint's."""
    from safetensors.torch import load_file, save_file

    def write():
        tensors = load_file(_dir("llama", "model.safetensors"))
        del tensors["model.layers.1.mlp.up_proj.weight"], tensors["model.norm.weight"]
        _make(_dir("llama_missing"))
        shutil.copy(_dir("llama", "config.json"), _dir("llama_missing", "config.json"))
        save_file(tensors, _dir("llama_missing", "model.safetensors"), metadata={"format": "pt"})
    _rank0(write)
    torch.manual_seed(dist.get_rank())  # different seeds per rank: the draw must still agree
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = ts.nn.from_pretrained(_dir("llama_missing"))
    message = " ".join(str(w.message) for w in caught)
    assert "model.layers.1.mlp.up_proj.weight" in message and "model.norm.weight" in message, message
    full = ts.collect_state_dict(model, model.state_dict())
    norms = [torch.empty_like(full["model.norm.weight"]) for _ in range(dist.get_world_size())]
    dist.all_gather(norms, full["model.norm.weight"])
    assert all(torch.equal(n, norms[0]) for n in norms) and torch.equal(norms[0], torch.ones_like(norms[0]))
    drawn = full["model.layers.1.mlp.up_proj.weight"]
    gathered = [torch.empty_like(drawn) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, drawn)
    assert all(torch.equal(g, gathered[0]) for g in gathered), "ranks drew different missing weights"
    std = models.llama().config.initializer_range
    assert abs(drawn.std().item() - std) < 0.3 * std, drawn.std()
    reference = load_file(_dir("llama", "model.safetensors"))
    assert torch.equal(full["model.layers.0.mlp.up_proj.weight"], reference["model.layers.0.mlp.up_proj.weight"])


def case_bad_checkpoints_raise_on_every_rank_before_reading():
    from transformers import GPT2LMHeadModel, LlamaForCausalLM
    expect_error(lambda: ts.nn.from_pretrained(_dir("no-such-folder")), "does not exist")
    expect_error(lambda: ts.nn.from_pretrained(LlamaForCausalLM, _dir("gpt2")), "'gpt2' model", "LlamaForCausalLM")
    expect_error(lambda: ts.nn.from_pretrained(_dir("llama"), intermediate_size=96),
                 "'model.layers.0.mlp.gate_proj.weight' has shape [80, 48]", "[96, 48]")
    expect_error(lambda: ts.nn.from_pretrained(_dir("gpt2"), n_head=1), "1 attention heads cannot be split over 2")

    def drop_a_file():
        shutil.copytree(_dir("llama_index"), _dir("llama_index_broken"))
        with open(_dir("llama_index_broken", "model.safetensors.index.json")) as f:
            victim = sorted(set(json.load(f)["weight_map"].values()))[1]
        os.remove(_dir("llama_index_broken", victim))
    _rank0(drop_a_file)
    expect_error(lambda: ts.nn.from_pretrained(_dir("llama_index_broken")), "which is missing from")
    expect_error(lambda: ts.nn.from_pretrained(GPT2LMHeadModel, _dir("vit")), "no config.json")


def case_save_pretrained_writes_the_unsharded_checkpoint():
    """model.save_pretrained (every rank) writes what plain transformers loads bitwise, in files of at
    most max_shard_size with the index, tied weights once; the folder is loaded at 4 and 3 ranks later."""
    for name in ("gpt2", "llama_kv1", "bert"):
        model = _load(name)
        model.save_pretrained(_dir("saved2", name), max_shard_size="20KB")

        def check():
            files = sorted(f for f in os.listdir(_dir("saved2", name)) if f.endswith(".safetensors"))
            assert len(files) > 2 and os.path.isfile(_dir("saved2", name, "model.safetensors.index.json")), files
            reference = _reference(name)
            back = type(reference).from_pretrained(_dir("saved2", name))
            for key, value in reference.state_dict().items():
                assert torch.equal(back.state_dict()[key], value), f"{name}: {key} after save_pretrained"
            if name == "gpt2":
                with open(_dir("saved2", name, "model.safetensors.index.json")) as f:
                    keys = json.load(f)["weight_map"]
                assert "lm_head.weight" not in keys and "transformer.wte.weight" in keys, sorted(keys)[:4]
        _rank0(check)



def _original_format_models():
    """Models whose transformers 5 save reverts its conversion mapping: Mixtral's and Qwen2-MoE's fused
    experts are written per expert (w1/w2/w3, gate/up/down_proj), GPT-NeoX's lm_head as embed_out."""
    from tests.distributed.zoo_models import ZOO, _decoder, _hf
    qwen2_moe = _hf("Qwen2MoeForCausalLM", "Qwen2MoeConfig", **_decoder(
        num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=40, shared_expert_intermediate_size=80,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, experts_implementation="eager"))
    return {"mixtral": (ZOO["mixtral"][0], "model.layers.1.block_sparse_moe.experts.3.w3.weight"),
            "qwen2_moe": (qwen2_moe, "model.layers.1.mlp.experts.3.up_proj.weight"),
            "gpt_neox": (ZOO["gpt_neox"][0], "embed_out.weight")}


def case_save_pretrained_writes_what_transformers_saves():
    """The parallelized model's save_pretrained writes the keys, dtypes and values (shapes included) of
    transformers' own save_pretrained of the unsharded model, which reverts its conversion mapping (the
    checkpoint's per-expert names); transformers and ts.nn.from_pretrained load it back bitwise, with the
    unsharded model's logits."""
    import copy
    from safetensors.torch import load_file
    for name, (build, original_key) in _original_format_models().items():
        torch.manual_seed(0)
        reference = build().to(F64).eval()
        _rank0(lambda: reference.save_pretrained(_dir("original", name, "transformers")))
        ts.nn.parallelize(copy.deepcopy(reference)).save_pretrained(_dir("original", name, "ours"),
                                                                    max_shard_size="40KB")
        expected = load_file(_dir("original", name, "transformers", "model.safetensors"))
        with open(_dir("original", name, "ours", "model.safetensors.index.json")) as f:
            files = set(json.load(f)["weight_map"].values())
        ours = {k: v for file in files for k, v in load_file(_dir("original", name, "ours", file)).items()}
        assert original_key in expected, f"{name}: transformers no longer saves {original_key!r}"
        assert set(ours) == set(expected), f"{name}: keys {sorted(set(ours) ^ set(expected))[:6]}"
        for key, value in expected.items():
            assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), f"{name}: {key} differs"
        back = type(reference).from_pretrained(_dir("original", name, "ours"))
        for key, value in reference.state_dict().items():
            assert torch.equal(back.state_dict()[key], value), f"{name}: {key} after transformers' from_pretrained"
        # Float64 experts need the eager loop (torch's grouped_mm takes no float64), which config.json omits.
        eager = {"experts_implementation": "eager"} if "experts" in original_key else {}
        loaded = ts.nn.from_pretrained(_dir("original", name, "ours"), **eager)
        _assert_state_equal(loaded, reference.state_dict(), f"{name} loaded")
        # The unsharded reference is transformers' load of its own save: built in float64, as ours is (the
        # float32-built model's rotary tables, moved to float64, are another model's to 1e-8).
        whole = type(reference).from_pretrained(_dir("original", name, "transformers"), **eager)
        with torch.no_grad():
            _assert_within(_outputs(loaded, name)[0], _outputs(whole, name)[0], 1e-12, f"{name} logits")

def _dcp_step(model, optimizer, seed):
    ids = _ids(seed)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def case_dcp_save_with_torch_get_state_dict():
    """torch's get_state_dict of a parallelized model and its AdamW, saved with dcp.save; rank 0 keeps
    the collected (unsharded) model and optimizer state to compare the later loads with."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    for name in ("gpt2", "llama_kv1"):
        torch.manual_seed(0)
        model = ts.nn.parallelize(HF[name]().to(F64))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(2):
            _dcp_step(model, optimizer, step)
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=_dir("dcp", name))
        full = ts.collect_state_dict(model, model.state_dict(), dst=0)
        full_optimizer = ts.collect_optimizer_state_dict(model, optimizer, dst=0)
        if dist.get_rank() == 0:
            torch.save((full, full_optimizer), _dir("dcp", f"{name}-reference.pt"))
        dist.barrier()


# ------------------------------------------------------------------ phases load4 and load3
def case_load_what_2_ranks_saved():
    for name in ("gpt2", "llama_kv1", "bert"):
        model = ts.nn.from_pretrained(_dir("saved2", name))
        _assert_state_equal(model, _reference(name).state_dict(), f"{name} saved at 2")


def case_dcp_load_with_torch_set_state_dict():
    """The DCP checkpoint saved at 2 ranks, loaded through get_state_dict / dcp.load / set_state_dict
    into a model and optimizer that took other steps: both equal what was saved, bitwise."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    for name in ("gpt2", "llama_kv1"):
        torch.manual_seed(5)
        model = ts.nn.parallelize(HF[name]().to(F64))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _dcp_step(model, optimizer, 9)
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=_dir("dcp", name))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        full = ts.collect_state_dict(model, model.state_dict(), dst=0)
        full_optimizer = ts.collect_optimizer_state_dict(model, optimizer, dst=0)
        if dist.get_rank() == 0:
            expected, expected_optimizer = torch.load(_dir("dcp", f"{name}-reference.pt"), weights_only=False)
            for key, value in expected.items():
                assert torch.equal(full[key], value), f"{name}: {key} after DCP at {dist.get_world_size()}"
            assert expected_optimizer["state"].keys() == full_optimizer["state"].keys()
            for index, values in expected_optimizer["state"].items():
                for key, value in values.items():
                    assert torch.equal(torch.as_tensor(full_optimizer["state"][index][key]), torch.as_tensor(value)), \
                        f"{name}: optimizer state {index}/{key} after DCP"
        dist.barrier()


def case_torch_full_state_dict_is_the_unsharded_one():
    """torch's get_state_dict(..., full_state_dict=True) of a parallelized model gives, on every rank, the
    unsharded model's own: bitwise before any step; after two SGD steps with momentum, the weights and the
    momentum within 1e-10 of the unsharded model trained alike (whole tensors, not this rank's shards).
    With AdamW (whose updates turn last-bit gradient differences into larger ones) the full state equals
    shardtorch's own collect bitwise. Loaded back with set_state_dict(full_state_dict=True) into a
    parallelized model of another seed, the same full state comes out bitwise."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                         set_state_dict)
    full = StateDictOptions(full_state_dict=True)

    def sgd(parameters):
        return torch.optim.SGD(parameters, lr=1e-2, momentum=0.9)

    def step(model, optimizer, seed):
        # The loss in float64 on whole logits (transformers' own loss computes in float32).
        ids = _ids(seed)
        shifted = F.pad(ids, (0, 1), value=-100)[..., 1:]
        F.cross_entropy(model(input_ids=ids).logits.reshape(-1, models.VOCAB), shifted.reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()

    for name in ("gpt2", "llama"):
        torch.manual_seed(0)
        reference = HF[name]().to(F64)
        torch.manual_seed(0)
        model = ts.nn.parallelize(HF[name]().to(F64))
        before, expected = get_model_state_dict(model, options=full), reference.state_dict()
        assert sorted(before) == sorted(expected), f"{name}: keys {sorted(set(before) ^ set(expected))}"
        for key, value in expected.items():
            assert before[key].shape == value.shape and torch.equal(before[key], value), f"{name}: {key} before steps"
        optimizer, reference_optimizer = sgd(model.parameters()), sgd(reference.parameters())
        for seed in range(2):
            step(model, optimizer, seed)
            step(reference, reference_optimizer, seed)
        model_state, optimizer_state = get_state_dict(model, optimizer, options=full)
        expected_model, expected_optimizer = get_state_dict(reference, reference_optimizer)
        for key, value in expected_model.items():
            _assert_within(model_state[key], value, 1e-10, f"{name}: {key} after two steps")
        assert sorted(optimizer_state["state"]) == sorted(expected_optimizer["state"]), name
        for key, values in expected_optimizer["state"].items():
            momentum = optimizer_state["state"][key]["momentum_buffer"]
            assert momentum.shape == values["momentum_buffer"].shape, f"{name}: {key} momentum's shape"
            _assert_within(momentum, values["momentum_buffer"], 1e-10, f"{name}: {key} momentum")
        # AdamW's state (two moments and a step count per parameter) against the collected state.
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _dcp_step(model, adamw, 3)
        model_state, optimizer_state = get_state_dict(model, adamw, options=full)
        collected = ts.collect_state_dict(model, model.state_dict())
        collected_optimizer = ts.collect_optimizer_state_dict(model, adamw, fqn_keys=True)
        for key, value in collected.items():
            assert torch.equal(model_state[key], value), f"{name}: {key} against collect"
        assert sorted(optimizer_state["state"]) == sorted(collected_optimizer["state"]), name
        for key, values in collected_optimizer["state"].items():
            for what, value in values.items():
                assert torch.equal(torch.as_tensor(optimizer_state["state"][key][what]), torch.as_tensor(value)), \
                    f"{name}: AdamW {key}/{what} against collect"
        # Back in: another seed's parallelized model and optimizer take the full state.
        torch.manual_seed(7)
        other = ts.nn.parallelize(HF[name]().to(F64))
        other_optimizer = torch.optim.AdamW(other.parameters(), lr=1e-2)
        _dcp_step(other, other_optimizer, 5)
        set_state_dict(other, other_optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                       options=full)
        again_model, again_optimizer = get_state_dict(other, other_optimizer, options=full)
        for key, value in model_state.items():
            assert torch.equal(again_model[key], value), f"{name}: {key} after set_state_dict"
        for key, values in optimizer_state["state"].items():
            for what, value in values.items():
                assert torch.equal(torch.as_tensor(again_optimizer["state"][key][what]), torch.as_tensor(value)), \
                    f"{name}: optimizer {key}/{what} after set_state_dict"


def _vm_data_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmData")


def case_a_model_larger_than_the_memory_limit_loads_and_trains():
    """Every rank's data limit (RLIMIT_DATA: its heap and private writable maps) set 2/3 of the
    model's float32 weights above its current use: loading the whole model fails, loading it sharded
    and a training step succeed on every rank (4 ranks each need a quarter, and as much again for
    the gradients)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=16000, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)  # 116 MB
    path = _dir("limit")

    def write():
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(path)
    _rank0(write)
    whole = os.path.getsize(os.path.join(path, "model.safetensors"))
    budget = whole * 2 // 3
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (_vm_data_bytes() + budget, hard))
    try:
        try:
            LlamaForCausalLM.from_pretrained(path)
            loaded_whole = True
        except (MemoryError, RuntimeError, OSError):
            loaded_whole = False
        assert not loaded_whole, f"the whole model ({whole} bytes) loaded within a budget of {budget} bytes"
        model = ts.nn.from_pretrained(path)
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ids = torch.randint(0, 16000, (2, 16), generator=torch.Generator().manual_seed(0))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    assert torch.isfinite(loss), loss


def case_every_zoo_architecture_loads_and_draws_exactly():
    """Each Hugging Face architecture of the zoo (tests/distributed/zoo_models.py), saved by transformers
    (in its original format: GPT-NeoX's embed_out, Mixtral's per-expert w1/w2/w3, which transformers
    renames and merges when loading), loads each rank's slices bitwise; and from_config draws the
    unsharded model's own initialisation bitwise."""
    from tests.distributed.zoo_models import ZOO
    for name, (build, _) in ZOO.items():
        torch.manual_seed(0)
        reference = build()
        if not hasattr(reference, "save_pretrained"):
            continue
        _rank0(lambda: reference.save_pretrained(_dir("zoo", name)))
        model = ts.nn.from_pretrained(_dir("zoo", name), dtype=torch.float32)
        _assert_state_equal(model, reference.state_dict(), f"{name} loaded")
        torch.manual_seed(5)
        reference = build()
        torch.manual_seed(5)
        _assert_state_equal(ts.nn.from_config(build), reference.state_dict(), f"{name} drawn")


def case_sequence_parallel_loaded_model_gradients_match_unsharded():
    """from_pretrained(..., sequence_parallel=True) trains with the unsharded model's gradients: every
    parameter's gradient (collected) within 1e-10 of transformers' float64 model, the norms' weights and
    the row projections' biases included (their partial sums over the sequence are summed over the group
    by hooks on the loaded tensors, not on the meta tensors the model was split with)."""
    from tests.distributed.cases_parallelize import collected_grads
    for name in ("llama", "gpt2"):
        reference = type(_reference(name)).from_pretrained(_dir(name))
        model = _load(name, sequence_parallel=True)
        ids = _ids(3)
        for m in (reference, model):
            m.train()
            logits = m(input_ids=ids).logits
            if ts.utils.get_parallel_dim(logits) == -1:
                logits = ts.distributed.gather_replicated(logits, -1, full_size=models.VOCAB)
            (logits * torch.linspace(-1, 1, logits.numel(), dtype=F64).view_as(logits)).sum().backward()
        expected = {k: p.grad for k, p in reference.named_parameters(remove_duplicate=False)}
        for key, grad in collected_grads(model).items():
            if key in expected:
                _assert_within(grad, expected[key], 1e-10, f"{name} sequence-parallel gradient of {key}")
