"""What the proof's key sees of a model defined in a script (shardtorch/utils/code_identity/ through
model_identity.model_digest): each pair below is one script edited in one place so that a split by
heads would compute otherwise, and the two must get different digests; the outputs are checked to
differ too, so that each pair is a real change. Also: a digest reused in one process notices a patch
made after it (a builtin swapped, a global bound later, a mutable default changed, a variable of the
environment set), a site-packages
folder under the standard library's (conda, the python images) still counts as other code, and odd
attributes never make the digest raise."""
import functools
import os
import sys
import textwrap
import types

import torch
import torch.nn.functional as F
from torch import nn

from shardtorch.nn.whole_model.model_identity import model_digest
import shardtorch.utils.code_identity.files
import shardtorch.utils.code_identity.walk
from shardtorch.utils import code_identity

SCRIPT = '''
import functools, torch
from torch import nn
{pre}
class Attn(nn.Module):
    {classbody}
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.o = nn.Linear(8, 8)
        {init}
    def heads(self, t, b, s):
        return t.view(b, s, 2, 4).transpose(1, 2)
    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        q, k, v = [self.heads(t, b, s) for t in (q, k, v)]
        {body}
        a = torch.softmax(q @ k.transpose(-1, -2), -1) @ v
        return self.o(a.transpose(1, 2).reshape(b, s, 8))
'''


def _script(name, **parts):
    fields = dict(dict(pre="", classbody="pass", init="pass", body="pass"), **parts)
    module = types.ModuleType(name)
    sys.modules[name] = module
    exec(compile(textwrap.dedent(SCRIPT.format(**fields)), f"<{name}>", "exec"), module.__dict__)
    return module


def _differ(label, a, b, held=None):
    """Two versions of the script (under one module name: only the edit differs), or one version whose
    instances are given two values ``held`` (attribute, first value, second value) after construction:
    their outputs differ (a real edit) and so must their digests."""
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    first = a.Attn()
    torch.manual_seed(0)
    second = b.Attn()
    if held is not None:
        setattr(first, held[0], held[1])
        setattr(second, held[0], held[2])
    with torch.no_grad():
        assert not torch.allclose(first(x), second(x)), f"{label}: the edit does not change the outputs"
    assert model_digest(first) != model_digest(second), f"{label}: the same key for different computations"


def _flag(flag):
    """A forward that mixes the heads (each query meets the next head's keys) where ``flag`` holds."""
    return f"q = q.roll(1, dims=1) if {flag} else q"


def test_flags_the_forward_reads():
    body = _flag("self.HEAD_MINOR")
    _differ("class attribute", _script("s1", classbody="HEAD_MINOR = False", body=body),
            _script("s1", classbody="HEAD_MINOR = True", body=body))
    body = _flag("ORDER[0] == 1")
    _differ("module-level tuple", _script("s2", pre="ORDER = (0, 1)", body=body),
            _script("s2", pre="ORDER = (1, 0)", body=body))
    body = _flag("cfg.HEAD_MINOR")
    pre = "import types as _t; cfg = _t.ModuleType('cfg'); cfg.HEAD_MINOR = {}"
    _differ("a constant of another module", _script("s3", pre=pre.format(False), body=body),
            _script("s3", pre=pre.format(True), body=body))
    body = _flag("self.flags.head_minor")
    pre = "import collections; Flags = collections.namedtuple('Flags', 'head_minor')"
    _differ("a named tuple the module holds", _script("s4", pre=pre, init="self.flags = Flags(False)", body=body),
            _script("s4", pre=pre, init="self.flags = Flags(True)", body=body))


def test_code_reached_through_decorators_attributes_and_super():
    helper = "@torch.no_grad()\ndef mix(t):\n    return t{}\n"
    _differ("a decorated helper", _script("s5", pre=helper.format(""), body="q = mix(q)"),
            _script("s5", pre=helper.format(".roll(1, dims=1)"), body="q = mix(q)"))
    layout = "class Layout:\n    def split(self, t):\n        return t{}\n"
    _differ("a method of an object the module holds",
            _script("s6", pre=layout.format(""), init="self.layout = Layout()", body="q = self.layout.split(q)"),
            _script("s6", pre=layout.format(".roll(1, dims=1)"), init="self.layout = Layout()",
                    body="q = self.layout.split(q)"))
    base = "class Base(nn.Module):\n    def forward(self, t):\n        return t{}\n"
    sub = "class Mixer(Base):\n    def forward(self, t):\n        return super().forward(t)\n"
    _differ("super().forward of an edited base",
            _script("s7", pre=base.format("") + sub, init="self.mixer = Mixer()", body="q = self.mixer(q)"),
            _script("s7", pre=base.format(".roll(1, dims=1)") + sub, init="self.mixer = Mixer()",
                    body="q = self.mixer(q)"))
    pre = "import functools; mix = functools.partial(torch.roll, shifts={}, dims=1)"
    _differ("a partial's arguments", _script("s8", pre=pre.format(0), body="q = mix(q)"),
            _script("s8", pre=pre.format(1), body="q = mix(q)"))


def test_a_reused_walk_notices_later_patches():
    module = _script("s9", pre="def mix(t, opts={'roll': False}):\n    return t.roll(1, dims=1) if opts['roll'] else t\n",
                     body="q = mix(q)")
    model = module.Attn()
    base = model_digest(model)
    assert model_digest(model) == base
    module.mix.__defaults__[0]["roll"] = True  # a mutable default changed in place
    assert model_digest(model) != base
    module.mix.__defaults__[0]["roll"] = False
    assert model_digest(model) == base
    original = F.linear
    F.linear = torch.nn.functional.bilinear  # a builtin under a name torch's own Linear.forward loads
    try:
        assert model_digest(model) != base
    finally:
        F.linear = original
    assert model_digest(model) == base


def test_site_packages_under_the_standard_library_is_other_code(monkeypatch):
    """conda and the python Docker images keep site-packages inside the standard library's folder: the
    transformers code there must still be followed (its rotary helper patched changes the key)."""
    import sysconfig
    from tests.unit.test_model_identity import _llama
    from transformers.models.llama import modeling_llama
    site_packages = sysconfig.get_paths()["purelib"]
    monkeypatch.setattr(code_identity.files, "_STDLIB", (site_packages.rsplit("/", 1)[0] + "/",))
    monkeypatch.setattr(code_identity.files, "_named_only_files", {})
    monkeypatch.setattr(code_identity.files, "_library_classes", {})
    monkeypatch.setattr(code_identity.walk, "_walks", {})
    model = _llama()
    base = model_digest(model)
    original = modeling_llama.apply_rotary_pos_emb
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb",
                        lambda q, k, cos, sin, *a, **kw: tuple(t.roll(1, dims=1) for t in original(q, k, cos, sin)))
    assert model_digest(model) != base


def test_a_dict_keyed_by_functions_is_the_same_in_every_process():
    import os
    import subprocess
    script = textwrap.dedent('''
        import sys, torch
        from torch import nn
        from shardtorch.nn.whole_model.model_identity import model_digest
        def gelu(x):
            return x
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.p = nn.Linear(2, 2)
                self.fused = {gelu: "gelu_fused", "set": {"a", "b", "c"}}
            def forward(self, x):
                return self.p(x)
        print(model_digest(M()).hex())''')
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    digests = set()
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=repo))
        assert out.returncode == 0, out.stderr
        digests.add(out.stdout.strip().splitlines()[-1])
    assert len(digests) == 1, digests


class _Raising:
    @property
    def __dict__(self):
        raise RuntimeError("no")

    def __repr__(self):
        raise RuntimeError("no repr")


def test_odd_attributes_never_make_it_raise():
    for value in (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), torch.ones(3, dtype=torch.complex64).conj(),
                  _Raising(), {_Raising(): 1}, {1, _Raising()}, 10 ** 5000, [[[[[[[[[1]]]]]]]]],
                  functools.partial(torch.roll, shifts=1)):
        model = nn.Sequential(nn.Linear(2, 2))
        model[0].extra = value
        model_digest(model)
    cyclic = []
    cyclic.append(cyclic)
    model = nn.Sequential(nn.Linear(2, 2))
    model[0].extra = cyclic
    model_digest(model)


def test_what_decorated_methods_and_library_objects_read():
    """A class flag read by a decorated forward (functools.wraps, torch.no_grad) or through getattr; flags
    held in a SimpleNamespace or argparse.Namespace; a class method patched after the walk was reused."""
    wraps = ("import functools as _f\n"
             "def deco(fn):\n    @_f.wraps(fn)\n    def inner(*a, **k):\n        return fn(*a, **k)\n    return inner\n")
    script = SCRIPT.replace("    def forward(self, x):", "    @deco\n    def forward(self, x):")
    for label, pre, flag in (("functools.wraps", wraps, "self.MIX"), ("torch.no_grad", "deco = torch.no_grad()", "self.MIX"),
                             ("getattr", wraps, "getattr(self, 'MIX', False)")):
        pair = []
        for value in (False, True):
            name = f"d_{label.replace('.', '_')}_{value}"
            module = types.ModuleType(name)
            sys.modules[name] = module
            source = script.format(pre=pre, classbody=f"MIX = {value}", init="pass", body=_flag(flag))
            exec(compile(textwrap.dedent(source), f"<{name}>", "exec"), module.__dict__)
            pair.append(module)
        _differ(f"a class flag under a {label} forward", *pair)
    for holder in ("types.SimpleNamespace", "argparse.Namespace"):
        pre = "import types, argparse"
        _differ(f"flags in a {holder}",
                _script(f"n_{holder[:4]}a", pre=pre, init=f"self.args = {holder}(mix=False)", body=_flag("self.args.mix")),
                _script(f"n_{holder[:4]}b", pre=pre, init=f"self.args = {holder}(mix=True)", body=_flag("self.args.mix")))
    module = _script("s_patched", pre="class Heads:\n    @staticmethod\n    def mix(t):\n        return t\n",
                     body="q = Heads.mix(q)")
    model = module.Attn()
    base = model_digest(model)
    module.Heads.mix = staticmethod(lambda t: t.roll(1, dims=1))
    assert model_digest(model) != base, "a class method patched after the walk: the reused walk missed it"


class _Quantized(torch.Tensor):
    """A weight of another tensor class (what torchao's quantize_ leaves): same shape and dtype."""

    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        return super().__torch_function__(func, types_, args, kwargs or {})


def test_a_weight_of_a_tensor_subclass_changes_it():
    plain = nn.Sequential(nn.Linear(4, 4))
    other = nn.Sequential(nn.Linear(4, 4))
    other[0].weight = nn.Parameter(other[0].weight.detach().as_subclass(_Quantized))
    assert model_digest(plain) != model_digest(other)


def test_state_held_in_namespaces_enums_deep_objects_and_the_environment():
    """What a forward reads that the key once missed: a dict or a nested namespace inside a
    SimpleNamespace or an argparse Namespace the module holds, an Enum member and a nested tuple a held
    object's class defines, a flag four objects deep, and a variable of the environment."""
    import argparse

    class Box:
        def __init__(self, inner):
            self.inner = inner
    for label, make, flag in (
            ("a dict in a SimpleNamespace", lambda v: types.SimpleNamespace(heads=2, norm={"mix": v}),
             "self.cfg.norm['mix']"),
            ("a nested SimpleNamespace", lambda v: types.SimpleNamespace(attn=types.SimpleNamespace(mix=v)),
             "self.cfg.attn.mix"),
            ("a dict in an argparse Namespace", lambda v: argparse.Namespace(attn={"mix": v}), "self.cfg.attn['mix']"),
            ("a flag four objects deep", lambda v: Box(Box(Box(Box(v)))), "self.cfg.inner.inner.inner.inner")):
        module = _script("s20", body=_flag(flag))
        _differ(label, module, module, held=("cfg", make(False), make(True)))
    pre = ("import enum\nclass Mode(enum.Enum):\n    PLAIN = 0\n    MIX = 1\n"
           "class Cfg:\n    mode = Mode.{}\n    pairs = (('mix', {}),)\n")
    _differ("an Enum member a held object's class defines",
            _script("s21", pre=pre.format("PLAIN", False), init="self.cfg = Cfg()", body=_flag("self.cfg.mode is Mode.MIX")),
            _script("s21", pre=pre.format("MIX", False), init="self.cfg = Cfg()", body=_flag("self.cfg.mode is Mode.MIX")))
    _differ("a nested tuple a held object's class defines",
            _script("s22", pre=pre.format("PLAIN", False), init="self.cfg = Cfg()", body=_flag("dict(self.cfg.pairs)['mix']")),
            _script("s22", pre=pre.format("PLAIN", True), init="self.cfg = Cfg()", body=_flag("dict(self.cfg.pairs)['mix']")))
    module = _script("s24", pre="import os", body=_flag("os.environ.get('SHARDTORCH_TEST_MIX') == '1'"))
    model = module.Attn()
    os.environ.pop("SHARDTORCH_TEST_MIX", None)
    base = model_digest(model)
    os.environ["SHARDTORCH_TEST_MIX"] = "1"  # the walk of the same model, reused, must notice
    try:
        assert model_digest(model) != base, "a variable of the environment the forward reads"
    finally:
        del os.environ["SHARDTORCH_TEST_MIX"]
    assert model_digest(model) == base


def test_large_buffers_count_by_a_sample_and_deep_values_make_it_raise():
    """A buffer past 65,536 values (a per-head bias loaded after the proof) counts by an evenly spaced
    sample; a value nested past the key's depth makes the digest raise (parallelize then proves every
    time) rather than being cut short."""
    model = nn.Module()
    model.register_buffer("bias", torch.zeros(4, 130, 130))
    base = model_digest(model)
    model.bias.normal_()
    assert model_digest(model) != base
    deep = nn.Module()
    nested = [True]
    for _ in range(20):
        nested = [nested]
    deep.flags = nested
    try:
        model_digest(deep)
    except code_identity.values.TooDeep:
        pass
    else:
        raise AssertionError("a value nested 20 deep was described without raising")
