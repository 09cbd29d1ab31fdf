"""The ops' per-call scratch buffers (csrc/ops/scratch_buffer.h): a buffer of at
least 4 MiB is advised for transparent huge pages before its first touch (one
page fault per 2 MiB instead of per 4 KiB), and is otherwise a plain empty
tensor that torch's allocator accounts for. Their large outputs written whole
(a weight gradient) have their pages made present in one call instead."""
import os
import re
import subprocess
import sys

import pytest
import torch

import shardtorch as ts
from tests.launcher import REPO

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
    # In a fresh process: here, once glibc's mmap threshold has grown, an earlier test's large
    # buffer may have come from the heap and left its pages advised after it was freed, and a small
    # allocation reusing them (ours or torch's) would show advice that it was not given (seen in CI).
    code = """
import torch, shardtorch as ts
from tests.unit.test_scratch_buffer import HUGE, _vm_flags_at
t = ts._C._empty_scratch_buffer([8 << 20])  # 32 MiB
first_whole_page = (t.data_ptr() + HUGE - 1) & ~(HUGE - 1)
small = ts._C._empty_scratch_buffer([1 << 10])
plain = torch.empty(1 << 10)
print("hg" in _vm_flags_at(first_whole_page), "hg" in _vm_flags_at(small.data_ptr()),
      "hg" in _vm_flags_at(plain.data_ptr()))
"""
    large, small, plain = _in_fresh_process(code).split()
    assert large == "True"
    # A small buffer is left as torch's allocator gives it (no advice).
    assert small == plain, (small, plain)


def _in_fresh_process(code):
    """What ``code`` prints, run by a new interpreter of this environment with the repository first
    on its path (a heap of its own, none of this process's earlier allocations)."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _present_fraction(address, nbytes):
    """The fraction of the whole pages in [address, address + nbytes) that are
    present (/proc/self/pagemap's bit 63, readable without privileges),
    precise where smaps would show a merged mapping."""
    page = os.sysconf("SC_PAGE_SIZE")
    first, last = (address + page - 1) // page, (address + nbytes) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = f.read((last - first) * 8)
    present = sum(int.from_bytes(entries[i:i + 8], "little") >> 63 for i in range(0, len(entries), 8))
    return present / (last - first)


def _kernel_at_least(major, minor):
    found = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return found is not None and (int(found.group(1)), int(found.group(2))) >= (major, minor)


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap") or not _kernel_at_least(5, 14),
                    reason="MADV_POPULATE_WRITE needs Linux 5.14")
def test_a_large_output_has_its_pages_present_before_its_first_write():
    # In a fresh process, where 64 MiB is a fresh mapping (here earlier tests may have left the
    # allocator a heap that already holds that much, present).
    code = f"""
import torch, shardtorch as ts
from tests.unit.test_scratch_buffer import _present_fraction
t = ts._C._empty_prefaulted([16 << 20])
plain = torch.empty(16 << 20)
print(_present_fraction(t.data_ptr(), t.nbytes), _present_fraction(plain.data_ptr(), plain.nbytes))
"""
    ours, plain = map(float, _in_fresh_process(code).split())
    assert ours == 1.0, ours
    assert plain < 0.01, plain  # the control: torch's own empty is not yet present

    t = ts._C._empty_prefaulted([16 << 20])
    assert list(t.shape) == [16 << 20] and t.dtype == torch.float32 and t.is_contiguous()
    t.copy_(torch.arange(t.numel(), dtype=torch.float32))
    assert torch.equal(t[-5:], torch.arange(t.numel() - 5, t.numel(), dtype=torch.float32))
    small = ts._C._empty_prefaulted([3, 5])
    assert list(small.shape) == [3, 5]
