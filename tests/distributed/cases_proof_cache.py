"""Proofs kept and reused (shardtorch/nn/whole_model/proof_cache.py), on real ranks: a model proven
once is not run on the probe batch again, and still gives the unsharded numbers; a change to what
the model computes (a helper patched to mix heads, one instance's forward) is proven again and
refused; ranks that do not all have the proof all prove; ranks holding different weights are still
refused; SHARDTORCH_PROOF_CACHE=0 proves every time; a model on the meta device skips its miniature; a
kept proof's plan is read again instead of resolved, and resolved anew where it no longer fits; a class
attribute a forward reads through a held object, changed after the proof, is proven again and refused."""
import contextlib
import json
import os
import shutil
import tempfile
import types
import warnings

import torch
import torch.distributed as dist

import shardtorch as ts
from shardtorch.nn.whole_model import proof
from shardtorch.nn.whole_model.proof import ParallelizeProofError
from tests.distributed import parallelize_models as models
from tests.reference import assert_close, expect_error

F64 = torch.float64


@contextlib.contextmanager
def _cache(shared: bool = True, enabled: bool = True):
    """A fresh cache folder for the case (one for all ranks, or one per rank as on separate hosts)."""
    names = [tempfile.mkdtemp(prefix="shardtorch-proofs-") if dist.get_rank() == 0 or not shared else None]
    if shared:
        dist.broadcast_object_list(names, src=0)
    saved = {k: os.environ.get(k) for k in ("SHARDTORCH_CACHE_DIR", "SHARDTORCH_PROOF_CACHE")}
    os.environ["SHARDTORCH_CACHE_DIR"] = names[0]
    os.environ["SHARDTORCH_PROOF_CACHE"] = "1" if enabled else "0"
    try:
        yield names[0]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        dist.barrier()
        if dist.get_rank() == 0 or not shared:
            shutil.rmtree(names[0], ignore_errors=True)


@contextlib.contextmanager
def _calls_counted(owner, name):
    """How many times ``owner.<name>`` is called inside."""
    count = [0]
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)
    setattr(owner, name, counted)
    try:
        yield count
    finally:
        setattr(owner, name, original)


def _probes_counted():
    """How many times a probe batch runs through a model (the whole one, then the parallel one)."""
    return _calls_counted(proof, "run_probe")


def _resolves_counted():
    """How many times parallelize resolves a plan (apply.resolve: not when a kept plan is read again)."""
    from shardtorch.nn.whole_model import apply
    return _calls_counted(apply, "resolve")


def _built(build, seed=0):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build().to(F64)


def _ids():
    return torch.randint(3, models.VOCAB, (2, models.SEQ), generator=torch.Generator().manual_seed(5))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.detach()


def _entries(folder):
    return sorted(name for _, _, files in os.walk(folder) for name in files if name.endswith(".json"))


def case_a_proven_split_is_reused_and_exact():
    ids = _ids()
    with _cache() as folder, _probes_counted() as probes:
        ts.nn.parallelize(_built(models.llama))
        assert probes[0] == 2, f"the first parallelize ran {probes[0]} probes, not 2 (whole, parallel)"
        dist.barrier()
        assert len(_entries(folder)) == 1, _entries(folder)
        model = ts.nn.parallelize(_built(models.llama)).eval()
        assert probes[0] == 2, "the proven split was proven again"
        assert_close(_logits(model, ids), _logits(_built(models.llama).eval(), ids), F64, "Llama, proof reused")
    with _cache(enabled=False) as folder, _probes_counted() as probes:
        for _ in range(2):
            ts.nn.parallelize(_built(models.llama))
        assert probes[0] == 4, f"SHARDTORCH_PROOF_CACHE=0: {probes[0]} probes for two parallelize, not 4"
        assert not _entries(folder), _entries(folder)


def _rotary_rolled_over_heads(original):
    def rotary(q, k, cos, sin, *args, **kwargs):
        q, k = original(q, k, cos, sin, *args, **kwargs)
        return q.roll(1, dims=1), k  # queries of one head meet the keys of the next: whole heads mixed
    return rotary


def case_changed_code_is_proven_again_and_refused():
    """After the Llama is proven, its rotary helper patched to mix heads (as a kernels library patches a
    modeling file), or one attention's forward replaced on the instance, is not taken from the cache: it is
    proven and refused on every rank. Put back, the kept proof serves again."""
    from transformers.models.llama import modeling_llama
    with _cache(), _probes_counted() as probes:
        ts.nn.parallelize(_built(models.llama))
        original = modeling_llama.apply_rotary_pos_emb
        modeling_llama.apply_rotary_pos_emb = _rotary_rolled_over_heads(original)
        try:
            expect_error(lambda: ts.nn.parallelize(_built(models.llama)), "the split is not exact",
                         "'model.layers.0.self_attn' (attention", exception=ParallelizeProofError)
        finally:
            modeling_llama.apply_rotary_pos_emb = original
        model = _built(models.llama)
        q_proj = model.model.layers[1].self_attn.q_proj
        head = model.config.hidden_size // model.config.num_attention_heads

        def forward(self, x):
            return torch.nn.functional.linear(x, self.weight, self.bias).roll(head, -1)  # each head's queries move
        q_proj.forward = types.MethodType(forward, q_proj)  # to the next head: across the shards' boundaries
        expect_error(lambda: ts.nn.parallelize(model), "the split is not exact", exception=ParallelizeProofError)
        before = probes[0]
        ts.nn.parallelize(_built(models.llama))
        assert probes[0] == before, "the unchanged Llama was proven again"


def case_ranks_that_do_not_all_have_the_proof_all_prove():
    """Caches of their own (ranks on separate hosts): the proof removed on the last rank alone makes every
    rank prove, without waiting on each other, and every rank then has it."""
    last = dist.get_world_size() - 1
    with _cache(shared=False) as folder, _probes_counted() as probes:
        ts.nn.parallelize(_built(models.gpt2))
        if dist.get_rank() == last:
            shutil.rmtree(folder)
        dist.barrier()
        ts.nn.parallelize(_built(models.gpt2))
        assert probes[0] == 4, f"rank {dist.get_rank()}: {probes[0]} probes, not 4 (the proof ran again)"
        ts.nn.parallelize(_built(models.gpt2))
        assert probes[0] == 4, f"rank {dist.get_rank()}: the proof kept on every rank ran again"


def case_ranks_holding_different_weights_are_refused_with_a_kept_proof():
    with _cache(), _probes_counted() as probes:
        ts.nn.parallelize(_built(models.gpt2))
        model = _built(models.gpt2, seed=100 + dist.get_rank())
        expect_error(lambda: ts.nn.parallelize(model), "hold different models", "torch.manual_seed",
                     exception=ValueError)
        assert probes[0] == 2, "the refusal came from a probe, not from the kept proof's check"


def case_a_model_on_the_meta_device_skips_its_miniature_once_proven():
    config = models.llama().config
    cls = type(models.llama())
    with _cache(), _probes_counted() as probes:
        for _ in range(2):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ts.nn.from_config(cls, config, dtype=F64)
            assert not [w for w in caught if "not proven" in str(w.message)], [str(w.message) for w in caught]
        assert probes[0] == 2, f"{probes[0]} probes for two from_config: the miniature was proven twice"


def _shards(model):
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def case_a_kept_proof_keeps_its_plan():
    """The next parallelize reads the plan the proof kept again instead of resolving it, and splits the same
    modules the same way, exactly; a kept plan that no longer fits the model (its layout named otherwise in
    the file) is resolved and proven anew on every rank; a plan given as a dict is proven on its own."""
    from shardtorch.nn.whole_model import proof_cache
    ids = _ids()
    whole = _logits(_built(models.llama).eval(), ids)
    with _cache() as folder, _probes_counted() as probes, _resolves_counted() as resolves:
        first = ts.nn.parallelize(_built(models.llama))
        second = ts.nn.parallelize(_built(models.llama))
        assert (resolves[0], probes[0]) == (1, 2), f"resolved {resolves[0]} times, {probes[0]} probes"
        assert _shards(second) == _shards(first) != _shards(_built(models.llama))
        assert_close(_logits(second.eval(), ids), whole, F64, "Llama, plan kept")
        dist.barrier()
        if dist.get_rank() == 0:
            for top, _, files in os.walk(folder):
                for name in files:
                    path = os.path.join(top, name)
                    with open(path) as f:
                        entry = json.load(f)
                    entry["placements"] = [p[:2] + ["NoSuchLayout"] + p[3:] if p[2] else p for p in entry["placements"]]
                    with open(path, "w") as f:
                        json.dump(entry, f)
        dist.barrier()
        proof_cache._known.clear()  # this process's parsed entries: read the edited files
        third = ts.nn.parallelize(_built(models.llama))
        assert (resolves[0], probes[0]) == (2, 4), f"resolved {resolves[0]} times, {probes[0]} probes"
        assert_close(_logits(third.eval(), ids), whole, F64, "Llama, kept plan that no longer fits")
        plan = ts.nn.auto_plan(_built(models.llama))
        for _ in range(2):
            fourth = ts.nn.parallelize(_built(models.llama), plan=plan)
        assert (resolves[0], probes[0]) == (3, 6), f"resolved {resolves[0]} times, {probes[0]} probes"
        assert _shards(fourth) == _shards(first)


class _Heads:
    """A config object both attentions below hold; its head count is a class attribute."""
    num_heads = 4


class _AttentionByConfig(torch.nn.Module):
    """Views its heads by the held config's class attribute (as Phi-3 reads config.num_attention_heads)."""

    def __init__(self, config, width=16):
        super().__init__()
        self.config, self.head_dim = config, 4
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (torch.nn.Linear(width, width) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        heads = self.config.num_heads
        q, k, v = (p(x).view(b, t, heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.o_proj(torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, -1))


class _AttentionAnsweringHeads(_AttentionByConfig):
    """Views by its own head width; its head count, for whoever asks, is the config's: it fits a layout only
    where that count matches its width (8 x 2)."""

    def __init__(self, config, width=16):
        super().__init__(config, width)
        self.head_dim = 8

    def __getattr__(self, name):
        if name == "num_heads":
            return self.config.num_heads
        return super().__getattr__(name)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.o_proj(torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, -1))


class _HeldConfigModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        config = _Heads()
        self.emb = torch.nn.Embedding(37, 16)
        self.m, self.n = _AttentionByConfig(config), _AttentionAnsweringHeads(config)
        self.head = torch.nn.Linear(16, 37, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        x = x + self.m(x)
        return self.head(x + self.n(x))


def case_a_class_attribute_changed_after_the_proof_is_proven_again():
    """A head count held as a class attribute of an object the modules hold, changed after the split is
    proven and kept (4 heads, then 2): the kept proof and plan are not reused; the plan is resolved and the
    model proven again, and refused on every rank (at 2 ranks its forward views 2 heads where the split
    gives each rank 1; at 3, the 2 heads 'n' now answers cannot be split), never split silently wrong; put
    back, the kept proof serves again."""
    ids = torch.randint(0, 37, (2, 5), generator=torch.Generator().manual_seed(1))
    with _cache(), _probes_counted() as probes:
        model = ts.nn.parallelize(_built(_HeldConfigModel)).eval()
        with torch.no_grad():
            assert_close(model(ids), _built(_HeldConfigModel).eval()(ids), F64, "held config, 4 heads")
        _Heads.num_heads = 2
        try:
            if dist.get_world_size() == 2:
                expect_error(lambda: ts.nn.parallelize(_built(_HeldConfigModel)), "the split is not exact",
                             exception=ParallelizeProofError)
            else:  # 'n' now fits with 2 heads, which 3 ranks cannot split: the plan resolved anew says so
                expect_error(lambda: ts.nn.parallelize(_built(_HeldConfigModel)), "2 attention heads cannot be split",
                             exception=ValueError)
        finally:
            _Heads.num_heads = 4
        before = probes[0]
        ts.nn.parallelize(_built(_HeldConfigModel))
        assert probes[0] == before, "the unchanged model was proven again"
