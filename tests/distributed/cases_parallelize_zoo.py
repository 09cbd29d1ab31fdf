"""ts.nn.parallelize across the transformers zoo (tests/distributed/zoo_models.py), on real ranks, in
float64 against the same model unsharded: logits, loss, every parameter's gradient (collected) and every
parameter after AdamW steps (collected: the unsharded state dict), a relocated state dict giving the
unsharded logits, nothing of attention, MLP, experts or vocabulary left whole, and a model built on the
meta device split to the same shapes as a real one (what loading slice by slice relies on).

One case per architecture (``case_<name>_matches_unsharded``, made from ZOO below), so that a failure
names it."""
import contextlib
import warnings

import torch

import shardtorch as ts
from shardtorch.nn.whole_model.left_whole import WARNED, left_whole
from shardtorch.utils.shard_facts import named_parameter_shards
from tests.distributed import cases_parallelize as base
from tests.distributed.zoo_models import ZOO
from tests.reference import assert_close, expect_error

F64 = torch.float64


def _causal(model, parallel, seed, whole=True):
    ids, labels = base._tokens(seed)
    if parallel:
        out = model(input_ids=ids, labels=labels)
        return out.loss, base._whole(out.logits, whole)
    out = model(input_ids=ids)
    # transformers' own ForCausalLMLoss rounds float64 logits to float32: the reference is written out.
    loss = base._causal_reference_loss(out.logits, labels)
    if getattr(out, "aux_loss", None) is not None:  # the router's load-balancing loss, as the model adds it
        loss = loss + model.router_aux_loss_coef * out.aux_loss
    return loss, out.logits.detach()


def _own_loss(model, parallel, seed, whole=True, masked=True):
    """The model's own labels= loss (a whole-vocabulary torch cross-entropy in float64) as the reference."""
    ids, labels = base._tokens(seed)
    if masked:
        labels[:, ::2] = -100
    out = model(input_ids=ids, labels=labels)
    return out.loss, base._whole(out.logits, whole) if parallel else out.logits.detach()


STEPS = {"causal": _causal, "masked": _own_loss, "seq2seq": lambda *a, **k: _own_loss(*a, masked=False, **k),
         "image": base._image_step, "plain": base._plain_lm_step}


@contextlib.contextmanager
def _norms_in_float64():
    """transformers' OLMo 2 and Gemma 3 RMSNorms compute in float32 even for float64 inputs. Split by heads,
    their sums run in another order (the sums of squares of OLMo 2's norm over a whole projection, added over
    the group; the gradients of Gemma 3's per-head norm weight, summed over this rank's heads, then over the
    group), so the two agree to float32's rounding only. For the 1e-10 comparison both models run these
    norms in float64 here (case_float32_norms_agree_to_float32_rounding checks the unpatched models)."""
    from transformers.models.gemma3 import modeling_gemma3
    from transformers.models.olmo2 import modeling_olmo2

    def olmo2(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    def gemma3(self, x):
        return self._norm(x) * (1.0 + self.weight)
    patched = ((modeling_olmo2.Olmo2RMSNorm, olmo2), (modeling_gemma3.Gemma3RMSNorm, gemma3))
    originals = [(cls, cls.forward) for cls, _ in patched]
    for cls, forward in patched:
        cls.forward = forward
    try:
        yield
    finally:
        for cls, forward in originals:
            cls.forward = forward


def _quiet_build(build):
    def quiet():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return build()
    return quiet


def _check_architecture(name):
    build, kind = ZOO[name]
    build, step = _quiet_build(build), STEPS[kind]
    context = _norms_in_float64() if name in ("olmo2", "gemma3_text") else contextlib.nullcontext()
    with context:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            par = base.check_against_unsharded(build, step, name)
        left = [f"{n} ({c}): {k}" for n, c, k in left_whole(par) if k in WARNED]
        assert not left, f"{name}: left whole: {left}"
        assert not [w for w in caught if "parallelize" in str(w.message)], [str(w.message) for w in caught]
        base.check_relocated(build, step, f"{name}: relocated logits")


def _make_case(name):
    def case():
        _check_architecture(name)
    case.__name__ = f"case_{name}_matches_unsharded"
    case.__doc__ = f"{name}: exact against the unsharded model, fully split, relocatable."
    return case


for _name in ZOO:
    globals()[f"case_{_name}_matches_unsharded"] = _make_case(_name)


def case_float32_norms_agree_to_float32_rounding():
    # Unpatched, OLMo 2's and Gemma 3's float32 norms: the logits and the norms' gradients agree to float32's
    # rounding (the split OLMo 2 norm keeps float64: HeadShardedRMSNorm), and not better.
    for name in ("olmo2", "gemma3_text"):
        ref, par = base._pair(_quiet_build(ZOO[name][0]))
        loss_ref, logits_ref = _causal(ref, False, 4)
        loss_par, logits_par = _causal(par, True, 4)
        loss_ref.backward()
        loss_par.backward()
        grads = base.collected_grads(par)
        for what, got, expected in [("logits", logits_par, logits_ref)] + [
                (key, grads[key], p.grad) for key, p in ref.named_parameters() if "q_norm" in key]:
            error = ((got - expected).abs().max() / expected.abs().max()).item()
            assert error < 1e-6, f"{name} {what}: relative error {error} with float32 norms"


def _shapes(model):
    return {name: (tuple(param.shape), spec.dim, spec.full_size, spec.blocks, spec.unit, spec.parts)
            for name, param, spec in named_parameter_shards(model)}


def case_meta_built_models_split_to_the_real_shapes():
    """Loading builds the model on the meta device, parallelizes it, then reads each rank's pieces: every
    layout must split a meta model without reading a value, to the shapes and shard facts of a real one,
    and create no tensor on the meta device that loading would not fill (it fills parameters only)."""
    for name, (build, _) in ZOO.items():
        build = _quiet_build(build)
        torch.manual_seed(0)
        real = ts.nn.parallelize(build().to(F64))
        with torch.device("meta"):
            meta = build().to(F64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ts.nn.parallelize(meta)
        assert _shapes(meta) == _shapes(real), f"{name}: {_shapes(meta)} != {_shapes(real)}"
        real_params = {n: tuple(p.shape) for n, p in real.named_parameters(remove_duplicate=False)}
        meta_params = {n: tuple(p.shape) for n, p in meta.named_parameters(remove_duplicate=False)}
        assert meta_params == real_params, f"{name}: parameters differ"
        real_buffers = {n for n, b in real.named_buffers() if b.device.type != "meta"}
        assert {n for n, _ in meta.named_buffers()} == {n for n, _ in real.named_buffers()}, name
        assert real_buffers == {n for n, _ in real.named_buffers()}, name


def case_sequence_parallel_zoo_matches_unsharded():
    # The layouts with more than a pairing under sequence parallelism: key/value parts summed whole each
    # forward (multi-query, Phi-3's with fewer key/value heads than ranks at 3), per-head norms (their
    # gradients summed once, not again by the region's hook), ALiBi rows by head (Bloom).
    for name in ("falcon_multi_query", "phi3_kv2", "qwen3", "bloom"):
        build, kind = ZOO[name]
        base.check_against_unsharded(_quiet_build(build), STEPS[kind], f"{name} sp", name, sequence_parallel=True)
    # Refused before any collective: experts (the block flattens the sequence before them), an MLP inside a
    # whole layer (OPT's fc1 does not read the layer's input).
    for name, what in (("mixtral", "'model.layers.0.mlp.experts' (MixtralExperts) as 'experts'"),
                       ("opt", "'model.decoder.layers.0' (OPTDecoderLayer) as 'mlp'")):
        model = _quiet_build(ZOO[name][0])()
        expect_error(lambda: ts.nn.parallelize(model, sequence_parallel=True), what,
                     "cannot run inside a sequence-parallel region", exception=ValueError)


def case_sharded_checkpoints_of_unequal_parts_load_back():
    # save_sharded writes every piece of an unequal-parts split (Phi-3's and multi-query's fused q/k/v, a
    # key/value part on the first ranks only) as a box of the full tensor; load_sharded reads them back.
    import shutil
    import tempfile
    directory = [tempfile.mkdtemp(prefix="zoo_sharded_") if ts.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(directory, src=0)
    for name in ("phi3_kv2", "falcon_multi_query"):
        build, kind = ZOO[name]
        build = _quiet_build(build)
        torch.manual_seed(0)
        saved = ts.nn.parallelize(build().to(F64))
        path = f"{directory[0]}/{name}"
        ts.save_sharded(saved, path)
        torch.manual_seed(7)
        loaded = ts.nn.parallelize(build().to(F64))
        ts.load_sharded(loaded, path)
        assert_close(STEPS[kind](loaded, True, 3)[1], STEPS[kind](saved, True, 3)[1], F64, f"{name}: loaded logits")
    torch.distributed.barrier()
    if ts.distributed.get_rank() == 0:
        shutil.rmtree(directory[0])
