"""ParallelMarginLoss as the head of a model under ts.nn.parallel.fully_shard
(FSDP2 x tensor parallel, world 4 = 2 x 2), run inside test_fully_shard.py's
launch (cases_fully_shard.py imports these cases): at sample rate 1.0 it
trains as single-process float64 training of the unsharded model on the
global batch; class sampling is refused on every rank with its reason."""
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import shardtorch as ts
from tests.distributed.cases_data_parallel import _local_batch
from tests.reference import expect_error, margin_cross_entropy_reference, split_range

IN, FEATURES, CLASSES, BATCH = 6, 5, 13, 16   # 13 classes over 2: uneven shards
SCALE, MARGINS = 16.0, (1.0, 0.3, 0.1)
OPTIMIZERS = {"sgd": lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9),
              "adam": lambda p: torch.optim.Adam(p, lr=0.01)}


class MarginNet(nn.Module):
    def __init__(self, layout="2d", sample_rate=1.0):
        super().__init__()
        self.gather_batch = layout == "hybrid"
        self.backbone = nn.Linear(IN, FEATURES)
        self.head = ts.nn.ParallelMarginLoss(FEATURES, CLASSES, SCALE, MARGINS, sample_rate=sample_rate,
                                             dtype=torch.float64, chunk_size=4, seed=3)

    def forward(self, x, y):
        h = self.backbone(x)
        if self.gather_batch:  # every rank its own samples: the head sees the whole batch
            h, y = ts.distributed.gather(h, dim=0), ts.distributed.gather(y, dim=0)
        return self.head(h, y)


def _fully_sharded(layout="2d", sample_rate=1.0):
    torch.manual_seed(21)
    model = MarginNet(layout, sample_rate)
    model.backbone.double()
    return ts.nn.parallel.fully_shard(model, layout=layout)


def _batch(step):
    g = torch.Generator().manual_seed(900 + step)
    return torch.randn(BATCH, IN, generator=g, dtype=torch.float64), torch.randint(0, CLASSES, (BATCH,), generator=g)


def _train_and_compare(layout, kind, steps=3):
    model = _fully_sharded(layout)
    assert all(isinstance(p, DTensor) for p in model.parameters()), "fully_shard left a parameter plain"
    optimizer = OPTIMIZERS[kind](model.parameters())
    torch.manual_seed(21)  # the unsharded model: nn.Linear, then PartialFC's normal_(0, 0.01) class matrix
    backbone = nn.Linear(IN, FEATURES).double()
    weight = nn.Parameter(torch.empty(CLASSES, FEATURES, dtype=torch.float64).normal_(0, 0.01))
    reference = OPTIMIZERS[kind]([backbone.weight, backbone.bias, weight])
    for step in range(steps):
        x, y = _batch(step)
        reference.zero_grad()
        margin_cross_entropy_reference(backbone(x), weight, y, SCALE, MARGINS).backward()
        reference.step()
        optimizer.zero_grad()
        model(*_local_batch(layout, x, y, step)).backward()
        optimizer.step()
    lo, hi = split_range(CLASSES, 2, dist.get_rank() % 2)  # tp groups {0, 1} {2, 3}
    expected = {"backbone.weight": backbone.weight, "backbone.bias": backbone.bias, "head.weight": weight[lo:hi]}
    for name, p in model.named_parameters():
        got, want = p.full_tensor().detach(), expected[name].detach()
        assert got.shape == want.shape, (name, got.shape, want.shape)
        error = ((got - want).abs().max() / want.abs().max()).item()
        assert error <= 1e-9, f"{layout} {kind}: {name} differs from unsharded training by {error:.3g} (relative)"


def case_margin_loss_head_trains_like_the_unsharded_model():
    for layout in ("2d", "hybrid"):
        for kind in OPTIMIZERS:
            _train_and_compare(layout, kind)


def case_margin_loss_sampling_under_fully_shard_is_refused():
    model = _fully_sharded(sample_rate=0.5)
    x, y = _local_batch("2d", *_batch(0), 0)
    expect_error(lambda: model(x, y), "class sampling (sample_rate=0.5) cannot train under fully_shard",
                 "FSDP2 reduce-scatters dense gradients only", "use sample_rate=1.0", exception=RuntimeError)
    # Nobody was left in a collective; eval mode (every class) works under it.
    model.eval()
    with torch.no_grad():
        loss = model(x, y)
    assert torch.isfinite(loss), loss
    assert torch.equal(model.head.last_sampled_classes, torch.arange(model.head.weight.shape[0]))
