"""Runs TorchShard's own tests and projects (written for CUDA + NCCL) on CPU
with Gloo, for tests/compat/run_torchshard_suite.py: found first on
PYTHONPATH, Python imports it at start-up in every process (the ranks that
torch.multiprocessing spawns included). It changes nothing of what the code
computes, only where: ``.cuda()`` is the identity, NCCL is Gloo, DDP's
``device_ids`` are dropped, torch.cuda's
queries answer as for TORCHSHARD_RANKS devices, AMP is off. Two things that
are not CUDA: TorchShard's assertEqual opens pdb on a mismatch (which would
hang a rank without a terminal), so pdb.set_trace raises instead; and with
TORCHSHARD_FAKE_CIFAR=1, CIFAR10 (which minGPT downloads) is torchvision's
FakeData of the same shape, as this machine reaches no download server."""
import contextlib
import os
import pdb

import torch
import torch.distributed as dist

_RANKS = int(os.environ.get("TORCHSHARD_RANKS", "2"))

torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: _RANKS
torch.cuda.synchronize = lambda *args, **kwargs: None
torch.cuda.set_device = lambda *args, **kwargs: None
torch.cuda.manual_seed = lambda *args, **kwargs: None
torch.cuda.manual_seed_all = lambda *args, **kwargs: None
torch.cuda.current_device = lambda: 0
torch.Tensor.cuda = lambda self, *args, **kwargs: self
torch.nn.Module.cuda = lambda self, *args, **kwargs: self
torch.cuda.amp.autocast = lambda *args, **kwargs: contextlib.nullcontext()
torch.cuda.amp.GradScaler = lambda *args, **kwargs: torch.amp.GradScaler("cpu", enabled=False)

_init_process_group = dist.init_process_group


def _init_with_gloo(backend=None, *args, **kwargs):
    return _init_process_group("gloo", *args, **kwargs)


dist.init_process_group = _init_with_gloo

_ddp_init = torch.nn.parallel.DistributedDataParallel.__init__


def _ddp_on_cpu(self, module, device_ids=None, output_device=None, *args, **kwargs):
    # device_ids name CUDA devices; on CPU, DDP takes none.
    _ddp_init(self, module, None, None, *args, **kwargs)


torch.nn.parallel.DistributedDataParallel.__init__ = _ddp_on_cpu


def _mismatch(*args, **kwargs):
    raise AssertionError("TorchShard's assertEqual found a difference above its threshold (see the line above)")


pdb.set_trace = _mismatch

if os.environ.get("TORCHSHARD_FAKE_CIFAR") == "1":
    import torchvision.datasets

    def _fake_cifar10(root, train=True, transform=None, target_transform=None, download=False):
        return torchvision.datasets.FakeData(size=int(os.environ.get("TORCHSHARD_FAKE_CIFAR_SIZE", "16")),
                                             image_size=(3, 32, 32), num_classes=10, transform=transform,
                                             target_transform=target_transform, random_offset=0 if train else 1000)

    torchvision.datasets.CIFAR10 = _fake_cifar10
