"""The digest the proof's cache keys a split by (shardtorch/nn/whole_model/model_identity.py and
shardtorch/utils/code_identity/): the same for every build of a model, whatever its weights and in
every process; different after any change to what the model computes: its config, an instance's
attribute or forward, a hook, a dtype, a small buffer, and the code its forward reaches by name (a
patched helper, a registry entry, a patched torch.nn.functional function, a default argument)."""
import json
import os
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardtorch.nn.whole_model.model_identity import model_digest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
F64 = torch.float64

transformers = pytest.importorskip("transformers")


def _llama(seed=0, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = dict(vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**dict(config, **overrides))).to(F64)


def test_the_same_for_other_weights():
    assert model_digest(_llama(0)) == model_digest(_llama(1))


def test_the_same_in_every_process():
    """Two interpreters with different string hashing (frozenset constants, set attributes) agree."""
    script = ("import json, sys, torch; sys.path.insert(0, %r); from tests.unit.test_model_identity import _llama; "
              "from shardtorch.nn.whole_model.model_identity import model_digest; "
              "print(json.dumps(model_digest(_llama()).hex()))" % REPO)
    digests = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=REPO)
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        digests.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert digests[0] == digests[1] == model_digest(_llama()).hex()


def test_a_config_change_changes_it():
    assert model_digest(_llama()) != model_digest(_llama(num_key_value_heads=4))
    assert model_digest(_llama()) != model_digest(_llama(rms_norm_eps=1e-5))


def test_an_instance_change_changes_it():
    base = model_digest(_llama())
    model = _llama()
    model.model.layers[1].self_attn.scaling = 0.5  # one layer's attribute
    assert model_digest(model) != base
    model = _llama()
    attention = model.model.layers[0].self_attn
    attention.forward = types.MethodType(lambda self, *a, **k: type(self).forward(self, *a, **k), attention)
    assert model_digest(model) != base
    model = _llama()
    model.model.layers[0].mlp.register_forward_hook(lambda module, args, output: output * 2)
    assert model_digest(model) != base
    model = _llama()
    model.model.rotary_emb.inv_freq.mul_(2)  # a small buffer counts by its values
    assert model_digest(model) != base
    assert model_digest(_llama().to(torch.float32)) != base


def test_a_swapped_module_changes_it():
    base = model_digest(_llama())
    model = _llama()
    model.model.layers[0].mlp.act_fn = nn.GELU()
    assert model_digest(model) != base


def test_patched_code_changes_it_and_putting_it_back_restores_it():
    """A helper the attention calls by name, patched in its module (what kernels libraries do), and a
    torch.nn.functional function patched, are seen; a second call reuses the walk and still sees them."""
    from transformers.models.llama import modeling_llama
    model = _llama()
    base = model_digest(model)
    assert model_digest(model) == base  # the walk reused
    original = modeling_llama.apply_rotary_pos_emb

    def rotary(q, k, cos, sin, *args, **kwargs):
        q, k = original(q, k, cos, sin, *args, **kwargs)
        return q.roll(1, dims=1), k
    modeling_llama.apply_rotary_pos_emb = rotary
    try:
        assert model_digest(model) != base
    finally:
        modeling_llama.apply_rotary_pos_emb = original
    assert model_digest(model) == base
    original_silu = F.silu
    F.silu = lambda x, inplace=False: x * torch.sigmoid(x)
    try:
        patched = model_digest(model)
    finally:
        F.silu = original_silu
    assert model_digest(model) == base
    assert patched != base, "F.silu patched: the activation's code is reached through torch.nn.functional"


def test_a_registry_entry_changes_it():
    """transformers' attention functions are looked up by name in a registry: an entry replaced is seen."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    model = _llama(attn_implementation="sdpa")
    base = model_digest(model)
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def sdpa(*args, **kwargs):
        return original(*args, **kwargs)
    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
    try:
        assert model_digest(model) != base
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = original
    assert model_digest(model) == base


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return _helper(self.proj(x))


def _helper(x, scale=1.0):
    return x * scale


def test_a_default_argument_and_a_global_helper_change_it():
    module = sys.modules[__name__]
    model = _Scaled()
    base = model_digest(model)
    original = module._helper
    try:
        original.__defaults__ = (2.0,)
        assert model_digest(model) != base
        original.__defaults__ = (1.0,)
        assert model_digest(model) == base
        module._helper = lambda x, scale=1.0: x.flip(-1)
        assert model_digest(model) != base
    finally:
        original.__defaults__ = (1.0,)
        module._helper = original
    assert model_digest(model) == base


def test_tying_parameters_changes_it():
    """A head tied to the embedding after construction, with the config unchanged (tied or not, the same
    shapes): the plan resolved for it can differ, and the kept proof keeps the plan."""
    tied = _llama()
    tied.lm_head.weight = tied.model.embed_tokens.weight
    assert model_digest(tied) != model_digest(_llama())
    x = torch.randint(0, 97, (1, 5))
    assert not torch.equal(tied(input_ids=x).logits, _llama()(input_ids=x).logits)


class _Documented(nn.Module):
    num_heads = 3  # read by no method: only by a layout's fit (its head count against its width)

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x)


class _Held:
    scale = 2.0


class _ReadsHeld(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = _Held()

    def forward(self, x):
        return x * self.config.scale


def test_class_values_change_it():
    """A simple value a class defines, whether or not a method names it: a module class's (what a layout
    reads), a held object's class's (what a forward reads through it), and a class's __name__."""
    model = _Documented()
    base = model_digest(model)
    _Documented.num_heads = 4
    try:
        assert model_digest(model) != base
    finally:
        _Documented.num_heads = 3
    assert model_digest(model) == base
    held = _ReadsHeld()
    base, before = model_digest(held), held(torch.ones(2))
    _Held.scale = 3.0
    try:
        assert not torch.equal(held(torch.ones(2)), before)
        assert model_digest(held) != base
    finally:
        _Held.scale = 2.0
    _Documented.__name__ = "Conv1D"  # what type(m).__name__ class tests read
    try:
        changed = model_digest(_Documented())
    finally:
        _Documented.__name__ = "_Documented"
    assert changed != model_digest(_Documented())


def test_class_sets_the_same_in_every_process():
    """A class's set of names (in an order string hashing decides) gives one digest in every process."""
    script = ("import sys; sys.path.insert(0, %r); from torch import nn\n"
              "class M(nn.Module):\n"
              "    names = frozenset({'alpha', 'beta', 'gamma', 'delta', 'eps'})\n"
              "    other = {'x', 'y', 'z', 'w'}\n"
              "    def forward(self, x):\n"
              "        return x\n"
              "from shardtorch.nn.whole_model.model_identity import model_digest\n"
              "print(model_digest(M()).hex())" % REPO)
    digests = set()
    for seed in ("1", "2", "3"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=REPO)
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        digests.add(out.stdout.strip().splitlines()[-1])
    assert len(digests) == 1, digests
