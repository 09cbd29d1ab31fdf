"""The proof parallelize runs before it returns (shardtorch/nn/whole_model/proof.py), on real ranks:
models that look like known ones but compute otherwise are refused on every rank, naming the module
at fault and the plan that leaves it whole, and that plan then gives the unsharded model's numbers;
the zoo proves without a false alarm in bfloat16 (float64: every zoo case runs the proof); the proof
touches neither the RNG streams nor the gradients; verify=False skips it; a model whose inputs
cannot be told is warned about, and proven with probe=."""
import warnings

import torch

import shardtorch as ts
from shardtorch.nn.whole_model.proof import ParallelizeProofError
from tests.distributed import parallelize_models as models
from tests.distributed.lookalike_models import LOOKALIKES, TinyGPT
from tests.distributed.zoo_models import ZOO
from tests.reference import assert_close, expect_error

F64 = torch.float64

# What each look-alike's refusal names first: the module at fault, or the vocabulary path.
AT_FAULT = {
    "head_minor_llama": "'model.layers.0.self_attn' (attention",
    "log_softmax_gpt2": "the vocabulary path",
    "heads_mixed_after_attention": "'blocks.0.attn' (attention",
    "mlp_features_flipped": "'blocks.0.mlp' (mlp",
    "rotary_over_the_whole_projection": "'blocks.0.attn' (attention",
}
# The modules the refusal says to leave whole (every module of the kind at fault).
FIX = {
    "head_minor_llama": ["model.layers.0.self_attn", "model.layers.1.self_attn"],
    "log_softmax_gpt2": ["transformer.wte", "lm_head"],
    "heads_mixed_after_attention": ["blocks.0.attn", "blocks.1.attn"],
    "mlp_features_flipped": ["blocks.0.mlp", "blocks.1.mlp"],
    "rotary_over_the_whole_projection": ["blocks.0.attn", "blocks.1.attn"],
}


def proving_every_time(case):
    """The case runs with the proof cache off (SHARDTORCH_PROOF_CACHE=0): what it checks is the proof
    itself, which a proof kept by an earlier case of the launch would skip."""
    import functools
    import os

    @functools.wraps(case)
    def run():
        before = os.environ.get("SHARDTORCH_PROOF_CACHE")
        os.environ["SHARDTORCH_PROOF_CACHE"] = "0"
        try:
            return case()
        finally:
            if before is None:
                os.environ.pop("SHARDTORCH_PROOF_CACHE")
            else:
                os.environ["SHARDTORCH_PROOF_CACHE"] = before
    return run


def _built(build, dtype=F64):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build().to(dtype)


def _outputs(model, ids):
    out = model(input_ids=ids) if hasattr(model, "config") else model(ids)
    return (out.logits if hasattr(out, "logits") else out).detach()


def case_lookalikes_are_refused_on_every_rank_naming_the_module():
    for name, build in LOOKALIKES.items():
        expect_error(lambda: ts.nn.parallelize(_built(build)), "parallelize: the split is not exact",
                     AT_FAULT[name], "cannot be used", *(f"{n!r}: 'replicate'" for n in FIX[name]),
                     exception=ParallelizeProofError)


@proving_every_time
def case_the_plan_the_refusal_gives_matches_unsharded():
    """Each look-alike, built again and split by the plan its refusal names (the modules at fault whole),
    gives the unsharded model's logits within 1e-10 (and passes the proof)."""
    ids = torch.randint(3, models.VOCAB, (2, models.SEQ), generator=torch.Generator().manual_seed(5))
    for name, build in LOOKALIKES.items():
        reference = _built(build).eval()
        model = _built(build)
        plan = dict(ts.nn.auto_plan(model), **{module: "replicate" for module in FIX[name]})
        ts.nn.parallelize(model, plan=plan).eval()
        with torch.no_grad():
            assert_close(_outputs(model, ids), _outputs(reference, ids), F64, f"{name} with the plan {FIX[name]}")


@proving_every_time
def case_zoo_proves_in_bfloat16_without_false_alarm():
    """Every zoo architecture split in bfloat16 passes its proof (run in float32, parameters widened and
    narrowed back bitwise; float64: every zoo case of cases_parallelize_zoo.py runs it), and then runs
    in bfloat16 (Mixtral's experts once widened the hidden states to the router's float32)."""
    from shardtorch.nn.whole_model.proof import probe_inputs
    for name, (build, _) in ZOO.items():
        model = _built(build, torch.bfloat16)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        args, kwargs = probe_inputs(model)
        try:
            ts.nn.parallelize(model)
        except ParallelizeProofError as error:
            raise AssertionError(f"{name} in bfloat16: a false alarm: {error}") from None
        assert all(v.dtype == before[k].dtype for k, v in model.state_dict().items() if k in before), name
        with torch.no_grad():
            out = model(*args, **kwargs)
        logits = out.logits if hasattr(out, "logits") else out
        assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all(), f"{name} in bfloat16"


@proving_every_time
def case_proof_touches_neither_rng_nor_gradients():
    model = _built(models.gpt2)
    torch.manual_seed(7)
    before = torch.get_rng_state()
    ts.nn.parallelize(model)
    assert torch.equal(torch.get_rng_state(), before), "parallelize's proof moved the RNG stream"
    assert all(p.grad is None for p in model.parameters()), "parallelize's proof left gradients behind"
    assert model.training, "parallelize's proof left the model in eval mode"


def case_verify_false_skips_the_proof():
    # Skipped, the look-alike is split as the layouts read it: silently wrong, as documented.
    model = ts.nn.parallelize(_built(LOOKALIKES["head_minor_llama"]), verify=False)
    local = model.model.layers[0].self_attn.q_proj.weight.shape[0]
    assert local < 48, f"verify=False left the attention whole ({local} of 48 rows)"


class _Unknown(torch.nn.Module):
    """Inputs parallelize cannot tell: a 1-D convolution first."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(4, 24, 1)
        self.gpt = TinyGPT()

    def forward(self, signal, idx):
        return self.gpt(idx) + self.conv(signal).mean()


def case_unknown_inputs_are_warned_about_and_proven_with_probe():
    model = _built(_Unknown)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ts.nn.parallelize(model, plan={"gpt.blocks.0.attn": "attention"})
    assert any("not proven exact" in str(w.message) and "probe=" in str(w.message) for w in caught), \
        [str(w.message) for w in caught]
    idx = torch.randint(0, models.VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    signal = torch.randn(2, 4, 3, dtype=F64, generator=torch.Generator().manual_seed(2))
    ts.nn.parallelize(_built(_Unknown), plan={"gpt.blocks.0.attn": "attention"}, probe=((signal, idx), {}))
    bad = _built(_Unknown)
    bad.gpt.blocks[0].attn.mix_heads = True
    expect_error(lambda: ts.nn.parallelize(bad, plan={"gpt.blocks.0.attn": "attention"}, probe=((signal, idx), {})),
                 "'gpt.blocks.0.attn' (attention", exception=ParallelizeProofError)
    expect_error(lambda: ts.nn.parallelize(_built(_Unknown), probe=[signal]), "probe must be a dict",
                 exception=TypeError)


@proving_every_time
def case_ranks_holding_different_models_are_refused_before_the_split():
    torch.manual_seed(100 + ts.distributed.get_rank())  # no common seed: every rank draws its own weights
    model = models.gpt2().to(F64)
    expect_error(lambda: ts.nn.parallelize(model), "hold different models", "torch.manual_seed",
                 exception=ValueError)
    assert model.transformer.h[0].attn.c_attn.weight.shape == (60, 180), "split before the refusal"


@proving_every_time
def case_gradients_alone_wrong_are_refused():
    """A split whose outputs agree and whose gradients do not (sequence parallelism without the sums of
    the norms' partial gradients, as loading once lost them) is refused, naming those parameters."""
    from shardtorch.nn.whole_model import apply
    original = apply._sum_gradients_of
    apply._sum_gradients_of = lambda block, names, group: None
    try:
        expect_error(lambda: ts.nn.parallelize(_built(models.llama), sequence_parallel=True),
                     "the gradients of", "layernorm.weight", "while the outputs agree", "sequence_parallel=True",
                     exception=ParallelizeProofError)
    finally:
        apply._sum_gradients_of = original


def _shared_folder():
    """A fresh folder that every rank names (rank 0 makes it)."""
    import tempfile
    import torch.distributed as dist
    names = [tempfile.mkdtemp(prefix="shardtorch-proof-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(names, src=0)
    return names[0]


def case_models_never_whole_are_proven_on_a_miniature():
    """from_config and from_pretrained of a look-alike class (its config the model's it looks like) are
    refused on every rank before anything is read or drawn, naming the module at fault, as parallelize
    refuses the whole model; the plan that refusal names then loads the unsharded model's numbers."""
    import torch.distributed as dist
    from tests.distributed.lookalike_models import lookalike_class
    for name, config in (("head_minor_llama", models.llama().config), ("log_softmax_gpt2", models.gpt2().config)):
        cls = lookalike_class(name)
        for load in (lambda: ts.nn.from_config(cls, config, dtype=F64),
                     lambda: ts.nn.parallelize(_on_meta(cls, config))):
            expect_error(load, "proven on a miniature of " + cls.__name__, "the split is not exact", AT_FAULT[name],
                         "Nothing is split", exception=ParallelizeProofError)
    cls = lookalike_class("head_minor_llama")
    reference = _built(lambda: cls(models.llama().config))
    folder = _shared_folder()
    if dist.get_rank() == 0:
        reference.save_pretrained(folder)
    dist.barrier()
    expect_error(lambda: ts.nn.from_pretrained(cls, folder, dtype=F64), "proven on a miniature",
                 AT_FAULT["head_minor_llama"], *(f"{n!r}: 'replicate'" for n in FIX["head_minor_llama"]),
                 exception=ParallelizeProofError)
    plan = dict(ts.nn.auto_plan(_built(lambda: cls(models.llama().config))),
                **{module: "replicate" for module in FIX["head_minor_llama"]})
    # Its attention calls the eager kernel with the mask the model builds: the mask that eager gets.
    loaded = ts.nn.from_pretrained(cls, folder, dtype=F64, plan=plan, attn_implementation="eager")
    ids = torch.randint(3, models.VOCAB, (2, models.SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert_close(_outputs(loaded, ids), _outputs(reference.eval(), ids), F64, "head-minor Llama, loaded")


def _on_meta(cls, config):
    with torch.device("meta"):
        return cls(config).to(F64)


@proving_every_time
def case_the_zoo_never_whole_proves_without_false_alarm():
    """from_config of every transformers model of the zoo (float64; bfloat16 for a few, whose proof runs
    in float32 as parallelize's does) passes the miniature's proof without a warning that it is not
    proven (test_pretrained.py loads the zoo through it too); a meta model with no config to shrink
    is warned about."""
    for name, (build, _) in ZOO.items():
        model = _built(build)
        if not hasattr(model, "config") or not hasattr(type(model), "config_class"):
            continue
        for dtype in (F64, torch.bfloat16) if name in ("mixtral", "gemma2", "t5") else (F64,):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    ts.nn.from_config(type(model), model.config, dtype=dtype)
                except ParallelizeProofError as error:
                    raise AssertionError(f"{name} in {dtype}: a false alarm: {error}") from None
            unproven = [str(w.message) for w in caught if "not proven" in str(w.message)]
            assert not unproven, f"{name} in {dtype}: {unproven}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.device("meta"):
            bare = TinyGPT()
        ts.nn.parallelize(bare)
    assert any("no Hugging Face config" in str(w.message) and "not proven" in str(w.message) for w in caught), \
        [str(w.message) for w in caught]


def case_a_plan_the_model_declares_splits_its_own_code_exactly():
    """A model of its own code (tests/distributed/custom_code_models.py: no layout knows its modules)
    is split by the tensor-parallel plan it declares (transformers' base_model_tp_plan), proven, and
    gives the unsharded model's loss, logits and gradients within 1e-10; from_config proves it on a
    miniature. Its variant that reshapes by an attribute's head count is refused on every rank."""
    from tests.distributed.custom_code_models import custom_code_classes
    config_class, model_class = custom_code_classes()
    reference = _built(lambda: model_class(config_class()))
    model = ts.nn.parallelize(_built(lambda: model_class(config_class())))
    attention = model.body.blocks[0].attn
    size, rank = ts.distributed.get_world_size(), ts.distributed.get_rank()
    heads = 4 // size + (rank < 4 % size)  # whole heads of 12 features (the attention's head_dim)
    assert attention.wq.weight.shape[0] == 12 * heads, "the declared plan did not split wq by heads"
    assert model.body.blocks[1].ffn.w_out.weight.shape[1] < 80, "the declared plan did not split w_out"
    ids = torch.randint(3, 96, (2, models.SEQ), generator=torch.Generator().manual_seed(5))
    for m in (model, reference):
        m(input_ids=ids, labels=ids).loss.backward()
    assert_close(model(input_ids=ids).logits.detach(), reference(input_ids=ids).logits.detach(), F64, "logits")
    from tests.distributed.cases_parallelize import collected_grads
    grads = collected_grads(model)
    for name, p in reference.named_parameters():
        assert_close(grads[name], p.grad, F64, f"gradient of {name}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ts.nn.from_config(model_class, config_class(), dtype=F64)
    assert not [w for w in caught if "not proven" in str(w.message)], [str(w.message) for w in caught]
    expect_error(lambda: ts.nn.parallelize(_built(lambda: model_class(config_class(heads_from_attribute=True)))),
                 "the split model raises on the probe batch", "'body.blocks.0.attn.wq': 'replicate'",
                 exception=ParallelizeProofError)
    expect_error(lambda: ts.nn.from_config(model_class, config_class(heads_from_attribute=True), dtype=F64),
                 "proven on a miniature", "the split model raises", exception=ParallelizeProofError)
