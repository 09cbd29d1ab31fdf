"""ParallelMarginLoss: the margin softmax of face and identity recognition
(ArcFace, CosFace, SphereFace-style, combined) over a class-sharded weight
that the loss owns, with PartialFC's class sampling. The loss itself is the op
torch.ops.shard.parallel_linear_margin_cross_entropy (the fused chunked head);
this module holds the weight and draws the kept classes. See
docs/margin_loss.md."""
import math
from typing import Optional, Sequence

import torch
from torch import nn

from .. import _C
from ..distributed import collectives, state
from ..utils.fsdp_detection import is_dtensor, is_fsdp_module
from ..utils.parallel_dim import set_attribute
from ..utils.shard_facts import register_shard
from ..utils.shards import shard_range
from . import functional as TF
from .class_sampling import draw_kept_classes
from . import init
from .init import draw_on_cpu_

#: (m1, m2, m3) of the usual margins: the target logit is s * (cos(m1 theta + m2) - m3).
MARGIN_PRESETS = {
    "arcface": (1.0, 0.5, 0.0),
    "cosface": (1.0, 0.0, 0.35),
    "sphereface": (1.35, 0.0, 0.0),
    "combined": (1.0, 0.3, 0.2),
}
#: PartialFC's initialisation of the class weights: normal_(0, INIT_STD).
INIT_STD = 0.01


class ParallelMarginLoss(nn.Module):
    """Margin softmax over ``num_classes`` classes split across ``group``.

    Owns ``weight`` [local_classes, in_features], this rank's rows of the class
    matrix (uneven splits as ParallelLinear: the first num_classes % size ranks
    hold one more), initialised bitwise as the slice of
    ``torch.empty(num_classes, in_features).normal_(0, 0.01)`` drawn under the
    same seed. ``forward(embeddings, target) -> loss`` with ``embeddings``
    [*, in_features] whole on every rank and ``target`` [*] global class
    indices, the same on every rank of the group; see
    shardtorch.nn.functional.parallel_margin_cross_entropy for ``scale``,
    ``margins``, ``easy_margin``, ``ignore_index``, ``reduction`` and
    ``label_smoothing`` (or MARGIN_PRESETS for the usual margins).

    ``sample_rate`` in (0, 1]: PartialFC's class sampling in training mode.
    Each forward keeps every class of this rank's shard that is a target in
    the batch (of every data-parallel replica: their targets are gathered over
    the "dp" group), plus uniformly drawn other classes of the shard up to
    ``ceil(sample_rate * local_classes)``; the loss is over the union of the
    ranks' kept classes, and only their rows are computed. The weight's
    gradient is then a sparse COO tensor of the kept rows: train it with
    shardtorch.optim.RowSparseSGD or RowSparseAdam, which leave the other rows
    and their optimizer state untouched. The draw depends on ``seed`` (default
    torch.initial_seed() at construction), the shard and a step counter
    (the buffer ``sampling_step``, saved with the state dict), so it is reproducible and identical on the
    data-parallel replicas of a shard. In eval mode every class is used.
    After each forward ``last_sampled_classes`` holds this rank's kept local
    class indices (sorted int64).
    """

    def __init__(self, in_features: int, num_classes: int, scale: float = 64.0,
                 margins: Sequence[float] = MARGIN_PRESETS["arcface"], easy_margin: bool = False,
                 sample_rate: float = 1.0, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, device=None, dtype=None,
                 group: str = state.TENSOR_PARALLEL, chunk_size: int = TF.DEFAULT_CHUNK_SIZE,
                 seed: Optional[int] = None) -> None:
        super().__init__()
        for name, value in (("in_features", in_features), ("num_classes", num_classes),
                            ("chunk_size", chunk_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelMarginLoss: {name} must be a positive int, got {value!r}")
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) \
                or not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"ParallelMarginLoss: sample_rate must be in (0, 1], got {sample_rate!r}")
        if len(margins) != 3:
            raise ValueError(f"ParallelMarginLoss: margins must be (m1, m2, m3), got {margins!r}")
        TF._reduction_code(reduction, "ParallelMarginLoss")
        self.in_features, self.num_classes, self.group = in_features, num_classes, group
        self.scale, self.margins, self.easy_margin = float(scale), tuple(float(m) for m in margins), easy_margin
        self.sample_rate, self.ignore_index, self.reduction = float(sample_rate), ignore_index, reduction
        self.label_smoothing, self.chunk_size = label_smoothing, chunk_size
        self.seed = torch.initial_seed() if seed is None else int(seed)
        self.group_rank, self.group_size = state.get_group_rank(group), state.get_group_size(group)
        self._class_range = shard_range(num_classes, self.group_size, self.group_rank)
        local = self._class_range[1] - self._class_range[0]
        self.weight = nn.Parameter(torch.empty(local, in_features, device=device, dtype=dtype))
        # Class rows split (tensor dim 0): recorded on the layer; the tensor
        # carries TorchShard's mark of a column-parallel [in, out] view (1).
        register_shard(self, "weight", 0, num_classes, group)
        set_attribute(self.weight, 1, order_type=0)
        # A buffer, so that a checkpoint resumes the sequence of draws.
        self.register_buffer("sampling_step", torch.zeros((), dtype=torch.int64, device="cpu"))
        self.last_sampled_classes: Optional[torch.Tensor] = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draws this rank's rows of PartialFC's normal_(0, 0.01) class matrix."""
        lo, hi = self._class_range
        draw_on_cpu_(lambda w: _C.init_normal_shard_(w, self.num_classes, self.in_features, (lo, hi),
                                                     (0, self.in_features), 0.0, INIT_STD,
                                                     init.CHUNK_ELEMENTS),
                     self.weight)

    def forward(self, embeddings: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        sampled = None
        if self.training and self.sample_rate < 1.0:
            self._check_not_fully_sharded()
            sampled = self.sample_classes(target)
            self.last_sampled_classes = sampled
        else:
            self.last_sampled_classes = torch.arange(self.weight.shape[0], device=self.weight.device)
        return TF.parallel_margin_cross_entropy(
            embeddings, self.weight, target, self.scale, self.margins, self.easy_margin,
            self.ignore_index, self.reduction, self.label_smoothing, sampled, self.chunk_size,
            self.group, self.num_classes)

    def _check_not_fully_sharded(self) -> None:
        # Every rank has the same sample_rate and wrapping, so every rank
        # raises here, before any collective.
        if is_fsdp_module(self) or is_dtensor(self.weight):
            raise RuntimeError(
                f"ParallelMarginLoss: class sampling (sample_rate={self.sample_rate}) cannot train under "
                f"fully_shard (FSDP2): its weight gradient is row-sparse (the kept classes' rows only, so that "
                f"rows not kept and their optimizer state do not move), and FSDP2 reduce-scatters dense "
                f"gradients only; a dense one would give the rows not kept a zero gradient that momentum and "
                f"Adam act on. Under fully_shard use sample_rate=1.0; train with sampling without fully_shard "
                f"(eval mode, which uses every class, works under it)")

    @torch.no_grad()
    def sample_classes(self, target: torch.Tensor) -> torch.Tensor:
        """This step's kept local classes (sorted int64): the shard's targets
        (of every data-parallel replica) and drawn others up to
        ceil(sample_rate * local_classes). Advances ``sampling_step``."""
        lo, hi = self._class_range
        local = hi - lo
        labels = _targets_of_every_replica(target.reshape(-1), self.ignore_index)
        positives = _local_positives(labels, lo, hi, self.ignore_index, self.weight.device)
        keep = min(local, math.ceil(self.sample_rate * local))
        step = int(self.sampling_step)
        self.sampling_step.fill_(step + 1)
        if positives.numel() >= keep:
            return positives
        # PartialFC's distribution (the positives and uniformly drawn others),
        # drawn in time that scales with `keep` (class_sampling.py). The
        # generator depends on the seed, the shard and the step only: the
        # same on every data-parallel replica of a shard.
        device = self.weight.device
        generator = torch.Generator(device=device)
        generator.manual_seed(_mix(self.seed, self.group_rank, step))
        return draw_kept_classes(local, keep, positives.to(device), generator)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, num_classes={self.num_classes}, scale={self.scale}, "
                f"margins={self.margins}, easy_margin={self.easy_margin}, "
                f"sample_rate={self.sample_rate}, group={self.group!r}, "
                f"shard={tuple(self.weight.shape)}")


def _mix(seed: int, shard: int, step: int) -> int:
    """A 63-bit generator seed from (seed, shard, step) (splitmix64's constants)."""
    value = (seed * 0x9E3779B97F4A7C15 + (shard + 1) * 0xBF58476D1CE4E5B9 + (step + 1) * 0x94D049BB133111EB)
    value &= (1 << 64) - 1
    value ^= value >> 31
    return value & ((1 << 63) - 1)


def _local_positives(labels: torch.Tensor, lo: int, hi: int, ignore_index: int, device) -> torch.Tensor:
    """The distinct targets in [lo, hi), less lo, sorted int64 on ``device``. One host read (their
    count) on CUDA, where a boolean mask and torch.unique would each wait for the device."""
    labels = labels.to(device)
    mine = (labels >= lo) & (labels < hi) & (labels != ignore_index)
    # Every label outside the shard lands in the extra slot hi - lo, which is then left out.
    present = torch.zeros(hi - lo + 1, dtype=torch.bool, device=device)
    present[torch.where(mine, labels - lo, hi - lo)] = True
    present = present[:-1]
    return torch.nonzero_static(present, size=int(present.sum())).squeeze(1)


def _targets_of_every_replica(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``labels`` of every data-parallel replica, concatenated (this rank's
    alone without data parallelism): the positives every replica keeps."""
    if not state.is_initialized() or state.get_data_parallel_size() == 1:
        return labels
    group = state.get_data_parallel_group()
    size = state.get_data_parallel_size()
    count = torch.tensor([labels.numel()], device=labels.device)
    counts = [torch.empty_like(count) for _ in range(size)]
    collectives.all_gather(counts, count, group=group)
    longest = int(torch.stack(counts).max())  # one host read, not one per replica
    padded = torch.full((longest,), ignore_index, dtype=labels.dtype, device=labels.device)
    padded[:labels.numel()] = labels
    gathered = [torch.empty_like(padded) for _ in range(size)]
    collectives.all_gather(gathered, padded, group=group)
    return torch.cat(gathered)
