"""The README's "Python in ten lines", run as written (it initialises the
process group itself: launch with init=False, world 2), with its collectives
counted by the PyTorch profiler: ProcessGroupGloo records every collective it
runs as a "gloo:<collective>" event, whether Python's torch.distributed or the
C++ core (through c10d::ProcessGroup) called it, and the core's shared-memory
path (ranks of one host, csrc/comm/shared_memory_collectives.h) as
"shm:<collective>" where the data moves, so the count is of what crossed between
processes, not of what shardtorch's ops say they did."""
import os
import re

import torch
import torch.nn.functional as F
from torch.autograd.profiler import record_function

import shardtorch as ts
from tests.launcher import REPO
from tests.reference import shard_of, shard_range

LOSS_FORWARD, LOSS_BACKWARD = "readme_test:loss_forward", "readme_test:loss_backward"


def readme_code() -> str:
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    found = re.search(r"^## Python in ten lines\n+```python\n(.*?)^```", text, re.S | re.M)
    assert found, "README.md has no python block under '## Python in ten lines'"
    return found.group(1)


def _collectives(events, within=None):
    """Names of the collectives (Gloo's or shared memory's) among the profiler's
    events, in order, without the backend's prefix; ``within``: only those that
    start inside that (start, end) window (us)."""
    # A group's first small CPU collective sets up its shared memory segment, once, with Gloo
    # collectives inside the "shm:setup" range: not collectives of the step.
    setups = [(e.time_range.start, e.time_range.end) for e in events if e.name == "shm:setup"]
    found = []
    for event in sorted(events, key=lambda e: e.time_range.start):
        backend, _, collective = event.name.partition(":")
        if backend not in ("gloo", "shm") or not collective or event.name == "shm:setup":
            continue
        if any(start <= event.time_range.start <= end for start, end in setups):
            continue
        if within is None or within[0] <= event.time_range.start <= within[1]:
            found.append(collective)
    return found


def _window(events, name):
    (event,) = [e for e in events if e.name == name]
    return event.time_range.start, event.time_range.end


class _MarkLoss:
    """Marks, in the profile, the forward and the backward of every
    ParallelCrossEntropyLoss call (global module hooks: the README code is not
    edited), and keeps what the loss received."""

    def __init__(self):
        self.inputs, self.outputs, self._open = [], [], None

    def __enter__(self):
        self._handles = [torch.nn.modules.module.register_module_forward_pre_hook(self._before),
                         torch.nn.modules.module.register_module_forward_hook(self._after)]
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()

    def _before(self, module, args):
        if isinstance(module, ts.nn.ParallelCrossEntropyLoss):
            self._open = record_function(LOSS_FORWARD)
            self._open.__enter__()

    def _after(self, module, args, output):
        if not isinstance(module, ts.nn.ParallelCrossEntropyLoss):
            return
        self._open.__exit__(None, None, None)
        self.inputs.append(tuple(a.detach().clone() for a in args))
        self.outputs.append(output.detach().clone())
        # The loss's backward is the op's autograd node: mark from its start to its end.
        node = output.grad_fn
        assert "ParallelCrossEntropy" in node.name(), node.name()
        marker = record_function(LOSS_BACKWARD)

        def enter(grad_outputs):
            marker.__enter__()

        def leave(grad_inputs, grad_outputs):
            marker.__exit__(None, None, None)
        node.register_prehook(enter)
        node.register_hook(leave)


def case_readme_example_loss_is_one_collective_forward_and_none_backward():
    code = readme_code()
    assert "ts.nn.ParallelCrossEntropyLoss()" in code and "loss.backward()" in code, code
    namespace = {"__name__": "readme_example"}
    with _MarkLoss() as marks, torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        exec(compile(code, "README.md (Python in ten lines)", "exec"), namespace)
    events = prof.events()
    assert len(marks.outputs) == 1, "the README code should call its loss once"
    in_forward = _collectives(events, _window(events, LOSS_FORWARD))
    in_backward = _collectives(events, _window(events, LOSS_BACKWARD))
    assert len(in_forward) == 1, f"loss forward: {in_forward}"
    assert in_backward == [], f"loss backward: {in_backward}"
    # The rest of the step: the column-parallel layer's forward is local and its
    # backward all-reduces the input gradient once (init's collectives come before).
    from_loss_on = _collectives(events, (_window(events, LOSS_FORWARD)[0], float("inf")))
    assert from_loss_on == in_forward + ["all_reduce"], from_loss_on

    # The loss it printed is F.cross_entropy of the gathered logits (float64).
    (logits, target), loss = marks.inputs[0], marks.outputs[0]
    lo, hi = shard_range(100_003)
    assert logits.shape == (32, hi - lo), logits.shape
    whole = ts.distributed.gather_replicated(logits, -1, full_size=100_003)
    expected = F.cross_entropy(whole.double(), target)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)


def case_counter_sees_the_size_exchange_of_an_unmarked_input():
    """The control: the same count sees both collectives of the C++ op when the
    number of classes is not known (unmarked logits, parallel=True), so it does
    see collectives made from C++, and the one above is the whole story."""
    if not ts.distributed.is_initialized():
        ts.distributed.init_process_group(group_size=2)
    torch.manual_seed(0)
    full = torch.randn(4, 11, dtype=torch.float64)
    target = torch.tensor([0, 5, 10, 3])
    shard = shard_of(full, -1).clone()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        unknown = ts.nn.functional.parallel_cross_entropy(shard, target, parallel=True)
    counted_unknown = _collectives(prof.events())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        known = ts.nn.functional.parallel_cross_entropy(ts.utils.register_parallel_dim(shard, -1, 11), target)
    counted_known = _collectives(prof.events())
    assert len(counted_unknown) == 2, counted_unknown
    assert len(counted_known) == 1, counted_known
    expected = F.cross_entropy(full, target)
    torch.testing.assert_close(unknown, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(known, expected, rtol=1e-12, atol=1e-12)
