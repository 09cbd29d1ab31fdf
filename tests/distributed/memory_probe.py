"""Peak resident memory of a block of code, from the kernel's own high-water
mark (VmHWM), which /proc/self/clear_refs resets: it counts every byte the
process touched, tensors and communication buffers alike."""
import contextlib


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


@contextlib.contextmanager
def peak_extra_bytes(result: dict, name: str):
    """Stores in result[name] how far resident memory rose above its level at
    entry, at its highest, while the block ran."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS
    base = _status_kib("VmRSS")
    try:
        yield
    finally:
        result[name] = (_status_kib("VmHWM") - base) * 1024
