"""Pieces the example training programs share (train_classifier.py,
train_lm.py): checkpoints that resume at any size, the learning-rate schedule,
and the per-rank memory report against the unsharded model.

Imported by path from beside the programs (they put this folder on sys.path).
"""
import math
import os

import torch
import torch.distributed as dist

import shardtorch as ts


# ----------------------------------------------------------------------------- checkpoints
class Progress:
    """Rank 0's view of training: a tqdm bar (evaluation lines printed above
    it), or with ``enabled=False`` one printed line per step; other ranks
    print nothing."""

    def __init__(self, rank, steps, start_step, enabled):
        self.rank, self.bar = rank, None
        if rank == 0 and enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=steps, initial=start_step, unit="step", dynamic_ncols=True)

    def note(self, line):
        if self.bar:
            self.bar.write(line)
        elif self.rank == 0:
            print(line, flush=True)

    def step(self, line, **postfix):
        """One training step done: the bar advances showing ``postfix``, or ``line`` is printed."""
        if self.bar:
            self.bar.set_postfix(**postfix)
            self.bar.update(1)
        elif self.rank == 0:
            print(line, flush=True)

    def close(self):
        if self.bar:
            self.bar.close()


def save_checkpoint(directory, step, model_parts, model, optimizer, scaler, scheduler):
    """Everything is collected to rank 0 in the unsharded model's form, so
    that the checkpoint resumes at any number of ranks and any layout:
    one file per model part, optimizer.pt (the state the same optimizer over
    the unsharded model would hold: momentum, Adam moments, steps, learning
    rates; ZeroRedundancyOptimizer's too, consolidated) and trainer.pt (step,
    which is the data position, LR schedule, GradScaler, every rank's RNG
    state). Everything goes
    to DIR/step-N/; DIR/LATEST names the newest complete one and is replaced
    last, so a rank killed mid-save leaves the previous checkpoint in charge."""
    rank = ts.distributed.get_rank()
    version = os.path.join(directory, f"step-{step}")
    os.makedirs(version, exist_ok=True)
    for name, module in model_parts.items():
        full = ts.collect_state_dict(module, module.state_dict(), dst=0)
        if rank == 0:
            _atomic_save(full, os.path.join(version, f"{name}.pt"))
    full = ts.collect_optimizer_state_dict(model, optimizer, dst=0)
    if rank == 0:
        _atomic_save(full, os.path.join(version, "optimizer.pt"))
    del full
    rng = {"cpu": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None}
    every_rng = [None] * ts.distributed.get_world_size()
    dist.all_gather_object(every_rng, rng)
    if rank == 0:
        trainer = {"step": step, "world_size": ts.distributed.get_world_size(),
                   "group_size": ts.distributed.get_group_size(),
                   "scaler": scaler.state_dict() if scaler is not None else None,
                   "scheduler": scheduler.state_dict(), "rng": every_rng}
        _atomic_save(trainer, os.path.join(version, "trainer.pt"))
    dist.barrier()
    if rank == 0:
        latest = os.path.join(directory, "LATEST")
        with open(latest + ".tmp", "w") as f:
            f.write(f"step-{step}\n")
        os.replace(latest + ".tmp", latest)
    dist.barrier()


def latest_checkpoint(directory):
    """The newest complete checkpoint under DIR, or None."""
    try:
        with open(os.path.join(directory, "LATEST")) as f:
            return os.path.join(directory, f.read().strip())
    except FileNotFoundError:
        return None


def _atomic_save(obj, path):
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def load_checkpoint(directory, model_parts, model, optimizer, scaler, scheduler, seed):
    """Resumes from a checkpoint saved at any size: the model and the
    optimizer state are cut into this run's shards (ts.relocate_state_dict,
    ts.relocate_optimizer_state_dict), the schedule, scaler and step restored.
    RNG: rank r takes rank r's saved state; ranks the saved run did not have
    are seeded from (seed, step, rank), since no saved stream is theirs."""
    rank = ts.distributed.get_rank()
    directory = latest_checkpoint(directory) or directory
    trainer = torch.load(os.path.join(directory, "trainer.pt"), weights_only=True)
    for name, module in model_parts.items():
        full = torch.load(os.path.join(directory, f"{name}.pt"), weights_only=True) if rank == 0 else None
        module.load_state_dict(ts.relocate_state_dict(module, full, src=0))
    full = torch.load(os.path.join(directory, "optimizer.pt"), weights_only=True) if rank == 0 else None
    optimizer.load_state_dict(ts.relocate_optimizer_state_dict(model, optimizer, full, src=0))
    del full
    scheduler.load_state_dict(trainer["scheduler"])
    if scaler is not None and trainer["scaler"] is not None:
        scaler.load_state_dict(trainer["scaler"])
    if rank < len(trainer["rng"]):
        torch.set_rng_state(trainer["rng"][rank]["cpu"])
        if trainer["rng"][rank]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(trainer["rng"][rank]["cuda"])
    else:
        torch.manual_seed(seed * 1_000_003 + trainer["step"] * 1009 + rank)
    return trainer["step"]


def make_scheduler(optimizer, args):
    """Linear warm-up over ``args.warmup_steps``, then a constant or a cosine
    (``args.lr_schedule``) learning rate to ``args.steps``."""
    def factor(step):
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        if args.lr_schedule == "cosine":
            progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return 1.0
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ----------------------------------------------------------------------------- memory report
def human_bytes(n):
    return f"{n / 2**20:8.1f} MiB"


def local_tensor(tensor):
    """What this rank holds of a parameter (its slice, under fully_shard)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def held_bytes(grad):
    """Bytes a gradient holds: a row-sparse one (sampled margin loss) only its
    kept rows and their indices."""
    if grad.is_sparse:
        return grad._values().numel() * grad.element_size() + grad._indices().numel() * grad._indices().element_size()
    return local_tensor(grad).numel() * grad.element_size()


def memory_report(params, optimizer, unsharded_param_bytes, peak_bytes, unsharded_peak=None):
    """Two lines for this rank: its parameter memory and measured peak training
    memory against the unsharded model's (``unsharded_peak``: measured the
    same way, or None), and the model state it holds (parameters + gradients +
    optimizer state, after the last step) against the whole model's 1/world."""
    params = list(params)
    rank, world = ts.distributed.get_rank(), ts.distributed.get_world_size()
    local_params = sum(local_tensor(p).numel() * p.element_size() for p in params)
    line = (f"[rank {rank}] parameters {human_bytes(local_params)} (unsharded {human_bytes(unsharded_param_bytes)}, "
            f"{unsharded_param_bytes / local_params:.2f}x); peak training memory {human_bytes(peak_bytes)}")
    if unsharded_peak is not None:
        line += f" (unsharded {human_bytes(unsharded_peak)}, {unsharded_peak / max(peak_bytes, 1):.2f}x)"
    optimizer_state = getattr(optimizer, "optim", optimizer).state  # ZeroRedundancyOptimizer: this rank's part
    held = local_params + sum(held_bytes(p.grad) for p in params if p.grad is not None)
    held += sum(local_tensor(v).numel() * v.element_size() for p in params for v in optimizer_state.get(p, {}).values()
                if torch.is_tensor(v) and v.dim() > 0)
    per_parameter = next((sum(1 for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
                          for st in optimizer_state.values() if st), 0)
    whole = unsharded_param_bytes * (2 + per_parameter)  # the parameter, its gradient, its state tensors
    line += (f"\n[rank {rank}] model state {human_bytes(held)} (parameters + gradients + optimizer state; "
             f"whole model {human_bytes(whole)}, ideal 1/{world}: {human_bytes(whole / world)}, "
             f"{held / (whole / world):.2f}x ideal)")
    return line


def print_in_rank_order(text):
    """Every rank prints ``text``, rank 0 first (collective: all ranks call it)."""
    rank = ts.distributed.get_rank()
    for r in range(ts.distributed.get_world_size()):
        if r == rank:
            print(text, flush=True)
        dist.barrier()
