"""The ops' per-call scratch buffers (csrc/ops/scratch_buffer.h): a buffer of at
least 4 MiB is advised for transparent huge pages before its first touch (one
page fault per 2 MiB instead of per 4 KiB), and is otherwise a plain empty
tensor that torch's allocator accounts for."""
import os
import re

import pytest
import torch

import shardtorch as ts

THP = "/sys/kernel/mm/transparent_hugepage/enabled"
HUGE = 2 << 20


def _vm_flags_at(address):
    """The VmFlags of this process's mapping holding ``address``."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    inside = False
    for line in lines:
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) <= address < int(m.group(2), 16)
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _thp_mode():
    try:
        with open(THP) as f:
            return re.search(r"\[(\w+)\]", f.read()).group(1)
    except OSError:
        return None


def test_a_scratch_buffer_is_an_empty_float_tensor_of_its_sizes():
    for sizes in ([0], [3, 5], [1024, 1024 + 7], [4, 1 << 20]):
        t = ts._C._empty_scratch_buffer(sizes)
        assert list(t.shape) == sizes and t.dtype == torch.float32 and t.device.type == "cpu"
        assert t.is_contiguous()
        t.copy_(torch.arange(t.numel(), dtype=torch.float64).reshape(sizes))  # writable, whole
        assert torch.equal(t.double().flatten(), torch.arange(t.numel(), dtype=torch.float64))


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps") or _thp_mode() in (None, "never"),
                    reason="needs Linux with transparent huge pages not disabled (" + THP + ")")
def test_a_large_scratch_buffer_is_advised_for_huge_pages_before_its_first_touch():
    t = ts._C._empty_scratch_buffer([8 << 20])  # 32 MiB
    first_whole_page = (t.data_ptr() + HUGE - 1) & ~(HUGE - 1)
    assert "hg" in _vm_flags_at(first_whole_page)
    # A small buffer is left as torch's allocator gives it (no advice).
    small = ts._C._empty_scratch_buffer([1 << 10])
    plain = torch.empty(1 << 10)
    assert ("hg" in _vm_flags_at(small.data_ptr())) == ("hg" in _vm_flags_at(plain.data_ptr()))
