"""Train an image classifier whose head has many classes, sharded with shardtorch.

Runs on 2 CPU processes by default and scales with flags:

    torchrun --nproc-per-node 2 examples/python/train_classifier.py              # CPU, Gloo
    torchrun --nproc-per-node 8 examples/python/train_classifier.py --device cuda --classes 1000000
    torchrun --nnodes 2 --node-rank R --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
             --nproc-per-node 8 examples/python/train_classifier.py --device cuda

It follows TorchShard's recipe: a backbone (torchvision's ResNet-18 when
installed and asked for, a small CNN otherwise) replicated under DDP, the
features and targets gathered over the tensor-parallel group
(``ts.distributed.gather(x, dim=0)``), a column-parallel classifier
(``ts.nn.ParallelLinear(..., dim=1)``) and the parallel cross-entropy loss.
``--layout 2d`` runs M-way data parallel x N-way tensor parallel instead.
``--fsdp`` replaces DDP by torch's FSDP2 (``ts.nn.parallel.fully_shard``): the
parameters, gradients and optimizer state are sharded over the data-parallel
dimension too, in either layout.

Data: synthetic but learnable by default (each class is a fixed random pattern
plus noise), with as many distinct classes, spread over the whole class range,
as the run visits about 16 times each (``--active-classes`` sets the number);
``--data PATH`` trains on an ImageFolder. Accuracy: top-1 / top-5 on a held-out
batch (fresh samples of the trained classes) before the first step, every
``--eval-every`` steps and after the last, with
``ts.nn.functional.parallel_linear_topk`` (the classifier scored chunk by chunk,
never the logits); samples/s counts the training steps only. At the end rank 0
prints the loss and accuracy trajectory, and each rank its parameter and peak
memory against the unsharded equivalent (plain DDP), measured.

At a million classes (see the README for the figures):

    torchrun --nproc-per-node 2 examples/python/train_classifier.py --loss arcface --sample-rate 0.1 \\
        --classes 1000000 --batch-size 64 --steps 400 --lr 0.1 --warmup-steps 40 --lr-schedule cosine \\
        --margin-scale 16 --eval-every 100 --eval-batch-size 128 --no-progress
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardtorch as ts
from shardtorch.utils.memory import PeakMemory

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the shared pieces beside this file
from training_common import (Progress, latest_checkpoint, load_checkpoint, make_scheduler,  # noqa: E402
                             memory_report, print_in_rank_order, save_checkpoint)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: Gloo; cuda: one GPU per process, NCCL (default: cpu)")
    p.add_argument("--classes", type=int, default=100_000, help="number of classes (default: 100000)")
    p.add_argument("--group-size", type=int, default=None,
                   help="ranks per tensor-parallel group (default: all ranks)")
    p.add_argument("--layout", choices=["hybrid", "2d"], default="hybrid",
                   help="hybrid: DDP over all ranks + gather before the sharded head (TorchShard's recipe); "
                        "2d: data-parallel groups x tensor-parallel groups (default: hybrid)")
    p.add_argument("--backbone", choices=["cnn", "resnet18"], default="cnn",
                   help="small built-in CNN, or torchvision's ResNet-18 (needs torchvision) (default: cnn)")
    p.add_argument("--features", type=int, default=256, help="feature size fed to the classifier (default: 256)")
    p.add_argument("--image-size", type=int, default=16, help="synthetic image side in pixels (default: 16)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank per step (default: 32)")
    p.add_argument("--steps", type=int, default=60, help="training steps (default: 60)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default: 0.05)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default: 0.9)")
    p.add_argument("--lr-schedule", choices=["constant", "cosine"], default="constant",
                   help="learning-rate schedule over --steps, after --warmup-steps of linear warm-up "
                        "(default: constant)")
    p.add_argument("--warmup-steps", type=int, default=0, help="linear learning-rate warm-up steps (default: 0)")
    p.add_argument("--active-classes", type=int, default=None,
                   help="synthetic data: how many distinct classes appear in the data, spread over the whole "
                        f"class range (default: as many as the run visits about {VISITS_PER_CLASS} times each, "
                        f"--steps x global batch / {VISITS_PER_CLASS}, at most --classes)")
    p.add_argument("--eval-every", type=int, default=None,
                   help="top-1 / top-5 accuracy on a held-out batch (fresh samples of the trained classes) with "
                        "ts.nn.functional.parallel_linear_topk every N steps, besides before the first and after "
                        "the last step; 0: only those two (default: 5 times a run, every ceil(steps / 5))")
    p.add_argument("--eval-batch-size", type=int, default=None,
                   help="held-out samples per rank at each evaluation (default: --batch-size)")
    p.add_argument("--data", default=None, help="train on an ImageFolder at PATH instead of synthetic data")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--amp", action="store_true",
                   help="mixed precision: bfloat16 autocast on CPU, float16 autocast + GradScaler on CUDA")
    p.add_argument("--zero", action="store_true",
                   help="ZeroRedundancyOptimizer: shard optimizer state over the data-parallel group")
    p.add_argument("--fsdp", action="store_true",
                   help="torch's FSDP2 (fully_shard) over the data-parallel dimension instead of DDP: parameters, "
                        "gradients and optimizer state sharded over it too")
    p.add_argument("--fused-loss", action="store_true",
                   help="compute classifier + loss chunk by chunk without materialising the logits")
    p.add_argument("--loss", choices=["softmax", "arcface", "cosface"], default="softmax",
                   help="softmax: a column-parallel classifier and the parallel cross-entropy; arcface / cosface: "
                        "ts.nn.ParallelMarginLoss, the margin softmax of identity recognition, which owns the "
                        "class-sharded weight (default: softmax)")
    p.add_argument("--sample-rate", type=float, default=1.0,
                   help="margin losses: PartialFC class sampling, the share of each rank's classes kept per step "
                        "besides the batch's targets, in (0, 1]; rows not kept and their momentum stay put "
                        "(ts.optim.RowSparseSGD) (default: 1.0)")
    p.add_argument("--margin-scale", type=float, default=64.0,
                   help="margin losses: the scale s of the cosine logits (default: 64)")
    p.add_argument("--save", default=None, help="directory to save a checkpoint to at the end (and every --save-every)")
    p.add_argument("--save-every", type=int, default=0, help="also save every N steps (default: only at the end)")
    p.add_argument("--resume", default=None,
                   help="directory of a checkpoint to resume from, saved at any number of ranks, "
                        "--group-size, --layout and with or without --zero")
    p.add_argument("--auto-resume", action="store_true",
                   help="resume from --save DIR when it holds a checkpoint (for torchrun --max-restarts)")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                   help="parameter and data dtype (default: float32; float64 for exactness checks)")
    p.add_argument("--dump-params", default=None,
                   help="rank 0 saves the final unsharded state dict of the model to this file")
    p.add_argument("--fail-at-step", type=int, default=None,
                   help="fault injection for tests: --fail-rank exits abruptly before this step, "
                        "on the first attempt only")
    p.add_argument("--fail-rank", type=int, default=1,
                   help="the rank --fail-at-step kills; -1: whichever rank this process is (default: 1)")
    p.add_argument("--fail-kills-agent", action="store_true",
                   help="fault injection for tests: the failing rank kills its torchrun agent first, "
                        "as a lost node would (the others then restart without it)")
    p.add_argument("--no-compare", action="store_true",
                   help="skip measuring the unsharded equivalent at the end")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (one line per step on rank 0)")
    p.add_argument("--log-json", default=None, help="rank 0 writes the per-step losses to this JSON file")
    return p


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0.0 < args.sample_rate <= 1.0:
        parser.error(f"--sample-rate must be in (0, 1], got {args.sample_rate}")
    if args.sample_rate != 1.0 and args.loss == "softmax":
        parser.error("--sample-rate samples the classes of a margin loss: use it with --loss arcface or cosface")
    if args.sample_rate != 1.0 and args.layout == "2d":
        # torch's DDP all-reduces sparse gradients of nn.Embedding only.
        parser.error("--sample-rate < 1 gives the class weights row-sparse gradients, which DDP's 2d layout "
                     "cannot average: use --layout hybrid")
    for flag in ("active_classes", "eval_batch_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be a positive number, got {value}")
    if args.eval_every is not None and args.eval_every < 0:
        parser.error(f"--eval-every must be 0 or a positive number of steps, got {args.eval_every}")
    if args.active_classes is not None and args.active_classes > args.classes:
        parser.error(f"--active-classes must be at most --classes={args.classes}, got {args.active_classes}")
    return args


# ----------------------------------------------------------------------------- data
#: Without --active-classes, the synthetic data has as many distinct classes as
#: the run can visit about this many times each: steps x global batch / VISITS.
#: A class's weight row learns from its own visits only, and the backbone
#: moves between them: at 4 visits a class, held-out top-1 stays near 2% after
#: 900 steps of ArcFace (s = 64, 100,000 classes, sample rate 0.1), at 16 it
#: reaches about 18% (7,200 classes).
VISITS_PER_CLASS = 16


def default_active_classes(num_classes, steps, global_batch):
    """Distinct classes of the synthetic data when --active-classes is not given."""
    return max(1, min(num_classes, steps * global_batch // VISITS_PER_CLASS))


class SyntheticPatterns:
    """Each active class is a fixed random low-resolution pattern upscaled to
    the image size; a sample is its class's pattern plus noise. The active
    classes are spread evenly over the whole class range, so that every shard
    holds some. The batch of a step is a pure function of (seed, step,
    data-parallel rank), so a resumed run sees exactly the data an
    uninterrupted one would; the held-out batch has noise of its own, drawn
    from a stream no training batch uses."""

    # Pixel noise: at 0.25 the backbone's features at initialisation already
    # tell 16,000 patterns apart (nearest class mean); at 0.5, under half of them.
    NOISE = 0.25

    def __init__(self, num_classes, active, image_size, seed):
        if not 1 <= active <= num_classes:
            raise ValueError(f"--active-classes must be in [1, --classes={num_classes}], got {active}")
        stride = num_classes // active
        self.class_ids = torch.arange(active) * stride
        g = torch.Generator().manual_seed(seed + 12345)
        # Low resolution held, upscaled per batch: 192 bytes a class, so that
        # hundreds of thousands of classes cost little memory.
        self.low = torch.randn(active, 3, 4, 4, generator=g)
        self.image_size, self.seed = image_size, seed

    def _draw(self, g, batch_size):
        which = torch.randint(len(self.class_ids), (batch_size,), generator=g)
        patterns = F.interpolate(self.low[which], size=(self.image_size, self.image_size), mode="bilinear",
                                 align_corners=False)
        images = patterns + self.NOISE * torch.randn(patterns.shape, generator=g)
        return images, self.class_ids[which]

    def batch(self, step, replica, batch_size):
        return self._draw(torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + replica), batch_size)

    def heldout(self, replica, batch_size):
        """Fresh samples of the trained classes (training seeds stay below
        2**40 for a billion steps)."""
        return self._draw(torch.Generator().manual_seed((self.seed + 1) * 2**40 + replica), batch_size)


class ImageFolderBatches:
    def __init__(self, path, image_size, batch_size, sampler_factory, seed):
        import torchvision
        from torchvision import transforms
        tf = transforms.Compose([transforms.Resize(image_size), transforms.CenterCrop(image_size),
                                 transforms.ToTensor()])
        self.dataset = torchvision.datasets.ImageFolder(path, transform=tf)
        self.sampler = sampler_factory(self.dataset)
        self.loader = torch.utils.data.DataLoader(self.dataset, batch_size=batch_size, sampler=self.sampler,
                                                  drop_last=True, num_workers=0)
        self.num_classes = len(self.dataset.classes)
        self.seed = seed
        self._epoch, self._iter, self._pos = -1, None, 0

    def batch(self, step, replica, batch_size):
        per_epoch = len(self.loader)
        epoch, index = divmod(step, per_epoch)
        if epoch != self._epoch or index < self._pos:
            self.sampler.set_epoch(epoch)
            self._epoch, self._iter, self._pos = epoch, iter(self.loader), 0
        while self._pos <= index:  # skipping batches replays a resumed run's order
            images, labels = next(self._iter)
            self._pos += 1
        return images, labels

    def heldout(self, replica, batch_size):
        """A fixed sample of the images (an ImageFolder has no held-out split:
        these are training images)."""
        order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed + 1))
        picked = [self.dataset[int(i)] for i in order[replica * batch_size:(replica + 1) * batch_size]]
        return torch.stack([image for image, _ in picked]), torch.tensor([label for _, label in picked])


# ----------------------------------------------------------------------------- model
class SmallCNN(nn.Module):
    def __init__(self, features):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1, stride=2), nn.BatchNorm2d(64), nn.ReLU(),
            nn.Conv2d(64, 128, 3, padding=1, stride=2), nn.BatchNorm2d(128), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, features))

    def forward(self, x):
        return self.body(x)


class ShardedClassifier(nn.Module):
    """Backbone, then (hybrid layout) the batch gathered over the tensor-parallel
    group, then the column-parallel head and the parallel loss. One module, so
    that one DDP wrapper manages every parameter the way its layout needs."""

    def __init__(self, backbone, head, gather_batch, fused_loss):
        super().__init__()
        self.backbone, self.head = backbone, head
        self.gather_batch, self.fused_loss = gather_batch, fused_loss
        self.criterion = ts.nn.ParallelCrossEntropyLoss(parallel=True)
        self.margin_loss = isinstance(head, ts.nn.ParallelMarginLoss)

    def forward(self, images, labels, evaluate=False):
        """The loss; with ``evaluate``, (the features the head scores, the
        labels), gathered as the head sees them, and no loss."""
        features = self.backbone(images)
        if self.gather_batch:  # TorchShard's recipe: gather the batch before the sharded head
            features = ts.distributed.gather(features, dim=0)
            labels = ts.distributed.gather(labels, dim=0)
        if evaluate:
            return features, labels
        if self.margin_loss:  # the margin softmax owns the class weights; chunk by chunk, no logits
            return self.head(features, labels)
        if self.fused_loss:  # classifier + loss chunk by chunk: the logits never exist whole
            # num_classes known here: no exchange of shard sizes on top of the loss's one collective
            # (the head's own method: under fully_shard its parameters are gathered for it)
            return self.head.linear_cross_entropy(features, labels)
        return self.criterion(self.head(features), labels)


def make_backbone(kind, features):
    if kind == "resnet18":
        import torchvision
        net = torchvision.models.resnet18(num_classes=features)
        return net
    return SmallCNN(features)


# ----------------------------------------------------------------------------- training
def main(argv=None):
    args = parse_args(argv)
    if "RANK" not in os.environ:
        sys.exit("launch with torchrun, e.g.: torchrun --nproc-per-node 2 examples/python/train_classifier.py")
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    world = int(os.environ["WORLD_SIZE"])
    ts.distributed.init_process_group(group_size=args.group_size or world)
    rank = ts.distributed.get_rank()
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    torch.manual_seed(args.seed)
    if device.type == "cpu":
        ts.utils.memory.track_cpu_memory()

    # Data: in the hybrid layout every rank reads different samples; in the
    # 2-D layout the ranks of a tensor-parallel group read the same ones.
    replica, replicas = ((rank, world) if args.layout == "hybrid"
                         else (ts.distributed.get_data_parallel_rank(), ts.distributed.get_data_parallel_size()))
    if args.data:
        def sampler_factory(dataset):
            if args.layout == "hybrid":
                return torch.utils.data.DistributedSampler(dataset, seed=args.seed, drop_last=True)
            return ts.utils.data.DistributedGroupSampler(dataset, seed=args.seed, drop_last=True)
        data = ImageFolderBatches(args.data, args.image_size, args.batch_size, sampler_factory, args.seed)
        num_classes = data.num_classes
    else:
        global_batch = args.batch_size * (world if args.layout == "hybrid" else replicas)
        active = args.active_classes or default_active_classes(args.classes, args.steps, global_batch)
        data = SyntheticPatterns(args.classes, active, args.image_size, args.seed)
        num_classes = args.classes
        if rank == 0:
            print(f"data: {active:,} distinct classes of {num_classes:,} (one in every {num_classes // active:,}), "
                  f"about {args.steps * global_batch / active:.1f} samples each over the run", flush=True)

    dtype = getattr(torch, args.dtype)
    backbone = make_backbone(args.backbone, args.features).to(device=device, dtype=dtype)
    if args.loss == "softmax":
        head = ts.nn.ParallelLinear(args.features, num_classes, dim=1, device=device, dtype=dtype)
    else:
        head = ts.nn.ParallelMarginLoss(args.features, num_classes, scale=args.margin_scale,
                                        margins=ts.nn.MARGIN_PRESETS[args.loss], sample_rate=args.sample_rate,
                                        device=device, dtype=dtype, seed=args.seed)
    model_parts = {"backbone": backbone, "head": head}
    model = ShardedClassifier(backbone, head, gather_batch=args.layout == "hybrid", fused_loss=args.fused_loss)
    if args.fsdp:  # FSDP2: the head over "dp", the rest over "dp" (2d) or the world (hybrid)
        model = ts.nn.parallel.fully_shard(model, ts.distributed.device_mesh(device.type), layout=args.layout)
    else:
        model = ts.nn.parallel.DistributedDataParallel(model, layout=args.layout)
    params = list(backbone.parameters()) + list(head.parameters())
    if args.zero and args.fsdp:
        sys.exit("--zero and --fsdp: choose one (fully_shard shards the optimizer state already)")
    if args.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        optimizer = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.SGD,
                                            process_group=ts.distributed.get_data_parallel_group(),
                                            lr=args.lr, momentum=args.momentum)
    elif args.loss != "softmax":
        # Row-sparse gradients of sampled classes: only the kept rows and their momentum move.
        optimizer = ts.optim.RowSparseSGD(params, lr=args.lr, momentum=args.momentum)
    else:
        optimizer = torch.optim.SGD(params, lr=args.lr, momentum=args.momentum)
    amp_dtype = torch.bfloat16 if device.type == "cpu" else torch.float16
    scaler = torch.amp.GradScaler("cuda") if args.amp and device.type == "cuda" else None
    scheduler = make_scheduler(optimizer, args)

    resume_from = args.resume
    if args.auto_resume and args.save and latest_checkpoint(args.save):
        resume_from = args.save
    start_step = load_checkpoint(resume_from, model_parts, model, optimizer, scaler, scheduler,
                                 args.seed) if resume_from else 0
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    def train_step(step):
        images, labels = data.batch(step, replica, args.batch_size)
        images, labels = images.to(device=device, dtype=dtype), labels.to(device)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=args.amp):
            loss = model(images, labels)
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        scheduler.step()
        return loss.item()

    heldout = data.heldout(replica, args.eval_batch_size or args.batch_size)
    heldout = heldout[0].to(device=device, dtype=dtype), heldout[1].to(device)

    @torch.no_grad()
    def evaluate():
        """Top-1 / top-5 of the held-out batch, the head scored chunk by chunk
        (parallel_linear_topk: the logits are never formed, nor gathered);
        counts summed over the data-parallel groups, which score different
        samples. Eval mode: BatchNorm's running statistics, no class sampling
        and nothing that training state depends on."""
        model.eval()
        try:
            with torch.autocast(device.type, dtype=amp_dtype, enabled=args.amp):
                features, labels = model(*heldout, evaluate=True)
            if args.fsdp:
                head.unshard()  # fully_shard gathers the head's parameters only around its forward methods
            features = features.to(head.weight.dtype)
            k = min(5, num_classes)
            if args.loss != "softmax":  # the cosine scores the margin loss trains
                _, top = ts.nn.functional.parallel_linear_topk(features, head.weight, k=k, normalize=True)
            else:
                _, top = ts.nn.functional.parallel_linear_topk(features, head.weight, head.bias, k=k)
            if args.fsdp:
                head.reshard()
        finally:
            model.train()
        hits = top == labels.unsqueeze(-1)
        counts = torch.tensor([hits[:, 0].sum().item(), hits.any(-1).sum().item(), labels.numel()],
                              dtype=torch.float64, device=device)
        if ts.distributed.get_data_parallel_size() > 1:
            dist.all_reduce(counts, group=ts.distributed.get_data_parallel_group())
        return counts[0].item() / counts[2].item(), counts[1].item() / counts[2].item(), int(counts[2].item())

    eval_every = args.eval_every if args.eval_every is not None else -(-args.steps // 5)
    heldout_name = "training-set sample" if args.data else "held-out"
    accuracy = {}

    def evaluate_and_report(step):
        accuracy[step] = evaluate()
        top1, top5, count = accuracy[step]
        progress.note(f"eval after step {step}: {heldout_name} top-1 {top1:.3f} top-5 {top5:.3f} "
                      f"({count} samples)")

    progress = Progress(rank, args.steps, start_step, enabled=not args.no_progress)
    losses, seen, train_seconds = {}, 0, 0.0
    peak = PeakMemory(device)
    with peak:
        evaluate_and_report(start_step)
        for step in range(start_step, args.steps):
            if args.fail_at_step == step and args.fail_rank in (rank, -1) and first_attempt:
                if args.fail_kills_agent:
                    import signal
                    os.kill(os.getppid(), signal.SIGKILL)
                os._exit(17)  # a rank dying mid-training, as a crash or a lost node would
            began = time.perf_counter()
            losses[step] = loss = train_step(step)
            train_seconds += time.perf_counter() - began  # samples/s: training steps only, not evaluation
            seen += args.batch_size * (world if args.layout == "hybrid" else replicas)
            rate = seen / train_seconds
            if step + 1 == args.steps or (eval_every and (step + 1) % eval_every == 0):
                evaluate_and_report(step + 1)
            top1, top5, _ = accuracy[max(accuracy)]  # the latest evaluation
            progress.step(f"step {step + 1}/{args.steps} loss {loss:.4f} acc {top1:.3f} top5 {top5:.3f} "
                          f"samples/s {rate:.0f}",
                          loss=f"{loss:.3f}", acc=f"{top1:.2f}", top5=f"{top5:.2f}", samples_s=f"{rate:.0f}")
            if args.save and args.save_every and (step + 1) % args.save_every == 0:
                save_checkpoint(args.save, step + 1, model_parts, model, optimizer, scaler, scheduler)
    progress.close()
    if rank == 0 and losses:
        (before, (top1_0, top5_0, _)), (after, (top1, top5, count)) = min(accuracy.items()), max(accuracy.items())
        print(f"trained steps {min(losses) + 1}-{max(losses) + 1}: loss {losses[min(losses)]:.3f} -> "
              f"{losses[max(losses)]:.3f}; {heldout_name} top-1 {top1_0:.3f} -> {top1:.3f}, top-5 {top5_0:.3f} -> "
              f"{top5:.3f} (steps {before} -> {after}, {count} samples); {seen / train_seconds:.1f} samples/s "
              f"(training steps only)", flush=True)
    if args.save:
        save_checkpoint(args.save, args.steps, model_parts, model, optimizer, scaler, scheduler)
    if args.dump_params:
        full = {name: ts.collect_state_dict(module, module.state_dict(), dst=0)
                for name, module in model_parts.items()}
        if rank == 0:
            torch.save(full, args.dump_params)
    if rank == 0 and args.log_json:
        import json
        with open(args.log_json, "w") as f:
            json.dump({str(k): v for k, v in losses.items()}, f)
    summary(args, device, backbone, head, num_classes, peak.peak_bytes, optimizer)
    ts.distributed.destroy_process_group()


def summary(args, device, backbone, head, num_classes, peak_bytes, optimizer):
    """Per-rank parameter and peak memory against the unsharded equivalent
    (the same backbone and a whole classifier, as plain DDP holds on every rank)."""
    params = list(backbone.parameters()) + list(head.parameters())
    backbone_bytes = sum(p.numel() * p.element_size() for p in backbone.parameters())  # whole under fully_shard too
    unsharded_params = backbone_bytes + (args.features + 1) * num_classes * 4
    unsharded_peak = None if args.no_compare else measure_unsharded_step(args, device, backbone, num_classes)
    print_in_rank_order(memory_report(params, optimizer, unsharded_params, peak_bytes, unsharded_peak))


def measure_unsharded_step(args, device, backbone, num_classes):
    """Peak memory of one training step of the plain model on this rank's batch
    (what each rank of plain DDP would need), measured the same way."""
    torch.manual_seed(args.seed)
    dtype = next(backbone.parameters()).dtype
    # A new backbone of the same kind (a copy of one under fully_shard would hold its DTensors).
    model = nn.Sequential(make_backbone(args.backbone, args.features).to(device=device, dtype=dtype),
                          nn.Linear(args.features, num_classes, device=device, dtype=dtype))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device, dtype=dtype)
    labels = torch.randint(num_classes, (args.batch_size,), device=device)
    with PeakMemory(device) as peak:  # two steps: the second holds momentum buffers, as in training
        for _ in range(2):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16 if device.type == "cpu" else torch.float16,
                                enabled=args.amp):
                loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
    return peak.peak_bytes


if __name__ == "__main__":
    main()
