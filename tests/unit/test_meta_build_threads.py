"""While one thread builds a model on the meta device, ``tensor.is_meta`` answers False there only
(shardtorch/pretrained/is_meta_while_building.py): another thread keeps torch's answer, and once no
build runs torch.Tensor is as torch made it."""
import threading

import torch

from shardtorch.pretrained.meta_build import build_recorded


def test_another_thread_keeps_torchs_is_meta_while_a_model_is_built():
    inside_build, other_has_looked = threading.Event(), threading.Event()
    seen = {}

    def factory():
        seen["building thread"] = torch.empty(2, device="meta").is_meta
        inside_build.set()
        assert other_has_looked.wait(60)
        return torch.nn.Linear(2, 2)

    builder = threading.Thread(target=build_recorded, args=(factory, False))
    builder.start()
    try:
        assert inside_build.wait(60)
        seen["other thread"] = torch.empty(2, device="meta").is_meta
        seen["other thread, real tensor"] = torch.empty(2).is_meta
    finally:
        other_has_looked.set()
        builder.join(60)
    assert seen == {"building thread": False, "other thread": True, "other thread, real tensor": False}
    assert "is_meta" not in torch.Tensor.__dict__
    assert torch.empty(2, device="meta").is_meta


def test_builds_in_two_threads_each_see_false_and_the_last_to_end_restores_torch():
    both_inside, release = threading.Barrier(2, timeout=60), threading.Event()
    seen = []

    def factory():
        both_inside.wait()
        seen.append(torch.empty(1, device="meta").is_meta)
        assert release.wait(60)
        return torch.nn.Linear(1, 1)

    builders = [threading.Thread(target=build_recorded, args=(factory, False)) for _ in range(2)]
    for builder in builders:
        builder.start()
    release.set()
    for builder in builders:
        builder.join(60)
    assert seen == [False, False]
    assert "is_meta" not in torch.Tensor.__dict__
