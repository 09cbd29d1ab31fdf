"""ParallelEmbedding on real ranks against torch.nn.Embedding (float64), and
the conversions of nn.Embedding / nn.Linear keeping every option."""
import itertools

import torch
from torch import nn

import shardtorch as ts
from shardtorch.nn import init as ts_init
from tests.reference import shard_of


def _size():
    return ts.distributed.get_group_size()


def _pair(num, dim_out, dim, seed=5, **options):
    torch.manual_seed(seed)
    ref = nn.Embedding(num, dim_out, dtype=torch.float64, **options)
    torch.manual_seed(seed)
    layer = ts.nn.ParallelEmbedding(num, dim_out, dim=dim, dtype=torch.float64, **options)
    return ref, layer


def _shard(full, dim):
    return shard_of(full, dim)


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10, msg=lambda m: f"{what}: {m}")


def _check(num, width, dim, tokens, **options):
    ref, layer = _pair(num, width, dim, **options)
    what = f"num={num} width={width} dim={dim} {options} tokens={tuple(tokens.shape)}"
    assert torch.equal(layer.weight, _shard(ref.weight.detach(), dim)), "init " + what
    torch.manual_seed(9)
    upstream = torch.randn(*tokens.shape, width, dtype=torch.float64)
    expected = ref(tokens)
    out = layer(tokens)
    _close(out, expected, "forward " + what)
    (expected * upstream).sum().backward()
    (out * upstream).sum().backward()
    grad, ref_grad = layer.weight.grad, ref.weight.grad
    if options.get("sparse"):
        assert grad.is_sparse, "sparse gradient expected " + what
        grad, ref_grad = grad.to_dense(), ref_grad.to_dense()
    _close(grad, _shard(ref_grad, dim), "weight grad " + what)
    # max_norm renormalises the referenced rows in place, as nn.Embedding does.
    _close(layer.weight.detach(), _shard(ref.weight.detach(), dim), "weight after forward " + what)


def case_forward_backward_match_nn_embedding_float64():
    size = _size()
    torch.manual_seed(0)
    for dim, (num, width) in itertools.product((0, 1), ((4 * size, 3 * size), (4 * size + 3, 3 * size + 1))):
        for shape in ((7,), (3, 5)):
            tokens = torch.randint(0, num, shape)
            tokens.view(-1)[0] = 1  # the padding row, when there is one
            _check(num, width, dim, tokens)
            _check(num, width, dim, tokens, padding_idx=1)
            _check(num, width, dim, tokens, padding_idx=-2)
            _check(num, width, dim, tokens, scale_grad_by_freq=True, padding_idx=1)
            _check(num, width, dim, tokens, sparse=True)


def case_max_norm_matches_nn_embedding():
    size = _size()
    torch.manual_seed(1)
    for dim, norm_type, max_norm in itertools.product((0, 1), (2.0, 1.0, float("inf")), (0.5, 1.5)):
        num, width = 5 * size + 1, 2 * size + 1
        tokens = torch.randint(0, num, (4, 6))
        _check(num, width, dim, tokens, max_norm=max_norm, norm_type=norm_type)
        _check(num, width, dim, tokens, max_norm=max_norm, norm_type=norm_type, padding_idx=0)


def case_more_ranks_than_rows_or_columns():
    size = _size()
    if size < 2:
        return
    tokens = torch.tensor([[0, size - 2, 1 % (size - 1)]])
    for dim in (0, 1):
        _check(size - 1, size - 1, dim, tokens)
        _check(size - 1, size - 1, dim, tokens, scale_grad_by_freq=True)


def case_init_equals_nn_embedding_bitwise():
    saved = ts_init.CHUNK_ELEMENTS
    try:
        for chunk, dtype, dim, (num, width) in itertools.product(
                (16, 100, saved), (torch.float32, torch.float64, torch.bfloat16), (0, 1),
                ((33, 5), (7, 3), (100, 13), (3, 2))):
            ts_init.CHUNK_ELEMENTS = chunk
            torch.manual_seed(3)
            ref = nn.Embedding(num, width, padding_idx=2, dtype=dtype)
            after_ref = torch.rand(2)
            torch.manual_seed(3)
            layer = ts.nn.ParallelEmbedding(num, width, padding_idx=2, dim=dim, dtype=dtype)
            after = torch.rand(2)
            what = (chunk, dtype, dim, num, width)
            assert torch.equal(layer.weight, _shard(ref.weight.detach(), dim)), what
            assert torch.equal(after, after_ref), f"generator state differs {what}"
    finally:
        ts_init.CHUNK_ELEMENTS = saved


def case_errors_name_the_argument():
    layer = ts.nn.ParallelEmbedding(10, 4, dim=0)
    for fn, fragment in (
            (lambda: layer(torch.tensor([10])), "indices must be in [0, num_embeddings = 10)"),
            (lambda: ts.nn.ParallelEmbedding(10, 4, dim=2), "dim must be 0"),
            (lambda: ts.nn.ParallelEmbedding(10, 4, padding_idx=10), "padding_idx must be within"),
            (lambda: torch.ops.shard.parallel_embedding(torch.tensor([1]), torch.zeros(99, 4), None, 0, 10,
                                                        False, False, "tp"), "weight.size(0) must be"),
            (lambda: torch.ops.shard.parallel_embedding(torch.tensor([1.0]), layer.weight, None, 0, 10,
                                                        False, False, "tp"), "must hold indices")):
        try:
            fn()
        except (RuntimeError, ValueError, IndexError) as e:
            assert fragment in str(e), f"{fragment!r} not in {e}"
        else:
            raise AssertionError(f"no error mentioning {fragment!r}")


def case_torch_compile_fullgraph_matches_eager():
    if _size() > 2:
        return  # compiling is slow on 4 ranks sharing 2 cores; the graph is the same at any size
    for dim in (0, 1):
        _, layer = _pair(4 * _size() + 1, 3, dim)
        tokens = torch.randint(0, layer.num_embeddings, (2, 5))
        eager = layer(tokens)
        eager.sum().backward()
        grad = layer.weight.grad.clone()
        layer.weight.grad = None
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        out = compiled(tokens)
        torch.testing.assert_close(out, eager)
        out.sum().backward()
        torch.testing.assert_close(layer.weight.grad, grad)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.words = nn.Embedding(11, 6, padding_idx=3, max_norm=1.2, norm_type=3.0, scale_grad_by_freq=True)
        self.inner = nn.Sequential(nn.Embedding(9, 5, sparse=True), nn.Identity())

    def forward(self, tokens):
        return self.words(tokens).sum(-1, keepdim=True) + self.inner[0](tokens % 9)


def case_convert_parallel_embedding_keeps_options_and_outputs():
    for dim in (0, 1):
        torch.manual_seed(0)
        model = _Model().double()
        model.inner[0].weight.requires_grad_(False)
        model.eval()
        plain = _Model().double()
        plain.load_state_dict(model.state_dict())
        plain.inner[0].weight.requires_grad_(False)
        plain.eval()
        converted = ts.nn.ParallelEmbedding.convert_parallel_embedding(model, dim=dim)
        words, inner = converted.words, converted.inner[0]
        assert isinstance(words, ts.nn.ParallelEmbedding) and isinstance(inner, ts.nn.ParallelEmbedding)
        assert (words.padding_idx, words.max_norm, words.norm_type, words.scale_grad_by_freq, words.sparse) == \
            (3, 1.2, 3.0, True, False)
        assert inner.sparse and not inner.weight.requires_grad and not converted.training
        assert words.weight.dtype == torch.float64 and words.dim == dim
        tokens = torch.randint(0, 11, (3, 4))
        _close(converted(tokens), plain(tokens), f"converted model dim={dim}")
        _close(words.weight.detach(), _shard(plain.words.weight.detach(), dim), "renormalised rows")
    single = ts.nn.ParallelEmbedding.convert_parallel_embedding(nn.Embedding(4, 2), dim=1)
    assert isinstance(single, ts.nn.ParallelEmbedding)


def case_convert_parallel_linear_keeps_every_option():
    for dim, bias, training, requires_grad in itertools.product((0, 1), (True, False), (True, False),
                                                                 (True, False)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Sequential(nn.Linear(5, 4 * _size() + 1, bias=bias, dtype=torch.float64)))
        model.train(training)
        model[0][0].weight.requires_grad_(requires_grad)
        converted = ts.nn.ParallelLinear.convert_parallel_linear(model, dim=dim)
        layer = converted[0][0]
        what = (dim, bias, training, requires_grad)
        assert isinstance(layer, ts.nn.ParallelLinear), what
        assert (layer.bias is not None) == bias, what
        assert layer.weight.dtype == torch.float64 and layer.weight.device.type == "cpu", what
        assert layer.weight.requires_grad == requires_grad, what
        assert layer.training == training and converted.training == training, what
    meta = ts.nn.ParallelLinear.convert_parallel_linear(nn.Linear(3, 4, device="meta"), dim=1)
    assert meta.weight.device.type == "meta"


def case_torchscript_matches_eager():
    for dim in (0, 1):
        _, layer = _pair(4 * _size() + 1, 3, dim, max_norm=0.9, padding_idx=2)
        _, twin = _pair(4 * _size() + 1, 3, dim, max_norm=0.9, padding_idx=2)
        scripted = torch.jit.script(twin)
        tokens = torch.randint(0, layer.num_embeddings, (2, 5))
        eager, script = layer(tokens), scripted(tokens)
        assert torch.equal(eager, script)
        eager.sum().backward()
        script.sum().backward()
        assert torch.equal(layer.weight.grad, twin.weight.grad)
        assert torch.equal(layer.weight, twin.weight)  # renormalised alike
