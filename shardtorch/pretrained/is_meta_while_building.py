"""``tensor.is_meta`` answering False in the thread that builds a model on the meta device, and as
torch answers in every other thread.

Why False: some of torch's initialisers return at once for a meta tensor (``trunc_normal_``,
``orthogonal_``, ``sparse_``, ``dirac_`` check ``tensor.is_meta``): the record would miss their
writes and the generator their draws, and the replay would give the weight what it held before.
While the model is built, Python code reading ``is_meta`` learns False, so they run their ops on the
meta tensors as they would on real ones (which the record sees); C++ is not affected.

Why per thread: ``torch.Tensor`` is one class for the whole process, and another thread (a data
loader, a second model being trained) must keep torch's answer. The dispatch mode that records the
build is already per thread (torch's mode stack is thread-local), so the answer is made so too: the
first build to start installs a property that consults a ``threading.local`` depth, the last to end
removes it (under a lock), so outside any build ``torch.Tensor`` is untouched.
"""
import contextlib
import threading

import torch

_building = threading.local()  # .depth: builds in progress in this thread
_lock = threading.Lock()
_builds = 0  # builds in progress in all threads
_shadowed = None  # what torch.Tensor itself held under is_meta before the first build (None: inherited)
_INHERITED = torch._C.TensorBase.__dict__["is_meta"]


def _is_meta(tensor: torch.Tensor) -> bool:
    if getattr(_building, "depth", 0):
        return False
    return (_shadowed if _shadowed is not None else _INHERITED).__get__(tensor, type(tensor))


_THREAD_SCOPED = property(_is_meta)


@contextlib.contextmanager
def meta_tensors_answer_not_meta():
    """Inside (in this thread only), ``tensor.is_meta`` is False for every tensor."""
    global _builds, _shadowed
    with _lock:
        if _builds == 0:
            _shadowed = torch.Tensor.__dict__.get("is_meta")
            torch.Tensor.is_meta = _THREAD_SCOPED
        _builds += 1
    _building.depth = getattr(_building, "depth", 0) + 1
    try:
        yield
    finally:
        _building.depth -= 1
        with _lock:
            _builds -= 1
            if _builds == 0:
                if _shadowed is None:
                    del torch.Tensor.is_meta
                else:
                    torch.Tensor.is_meta = _shadowed
                _shadowed = None
