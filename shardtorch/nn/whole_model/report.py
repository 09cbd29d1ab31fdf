"""verbose=True: the plan as applied, shard shapes, what stayed whole, and
the parameter memory of every rank against the whole model."""
from typing import List, Optional, Sequence, Tuple

from torch import nn

from ...utils.shard_facts import registered_shards


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters, each tensor counted once (tied ones too)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _split(spec) -> str:
    if spec.parts is not None:
        return f", parts {[length for length, _ in spec.parts]}"
    return ((f", {spec.blocks} fused parts" if spec.blocks > 1 else "")
            + (f", heads of {spec.unit}" if spec.unit > 1 else ""))


def print_report(model: nn.Module, placed: List[Tuple[str, str, str]], left: List[str], whole_bytes: int,
                 loss: Optional[str], group: str, size: int, rank_bytes: Sequence[int]) -> None:
    modules = dict(model.named_modules())
    lines = [f"parallelize over group {group!r} of {size} ranks:"]
    for name, style, notes in placed:
        lines.append(f"  {name or '(root)'}: {style}" + (f" [{notes}]" if notes else ""))
        for sub_name, sub in modules[name].named_modules() if name in modules else []:
            for pname, spec in registered_shards(sub).items():
                param = sub._parameters[pname]
                full = list(param.shape)
                full[spec.dim] = spec.full_size
                where = ".".join(n for n in (name, sub_name, pname) if n)
                lines.append(f"    {where}: shard {tuple(param.shape)} of {tuple(full)} (dim {spec.dim}"
                             + _split(spec) + ")")
    if loss:
        lines.append(f"  {loss}")
    lines.append("  left whole: " + (", ".join(left) if left else "nothing"))
    local = rank_bytes[0]
    lines.append(f"  parameters per rank: {local / 2**20:.2f} MiB of {whole_bytes / 2**20:.2f} MiB whole "
                 f"({local / max(whole_bytes, 1):.1%})")
    shares = ", ".join(f"{b / max(whole_bytes, 1):.1%}" for b in rank_bytes)
    lines.append(f"  share of the model's bytes by group rank: {shares} (largest "
                 f"{max(rank_bytes) / max(whole_bytes, 1):.1%}, 1/{size} = {1 / size:.1%})")
    print("\n".join(lines), flush=True)
