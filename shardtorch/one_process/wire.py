"""What goes between the caller and its device workers, and how.

Tensors travel as torch.multiprocessing shares them: a CPU tensor's storage moves to shared memory
and its file descriptor is passed (no copy per reader: every worker maps the caller's model), a CUDA
tensor as an IPC handle. Classes and functions that the receiver cannot import (a model class
written in a notebook cell, a lambda in generation arguments) go by value (cloudpickle); everything
else by reference, as pickle does.
"""
import io
import pickle
from collections import ChainMap
from multiprocessing.reduction import ForkingPickler

import cloudpickle
import torch.multiprocessing  # noqa: F401  (registers the tensor and storage reductions with ForkingPickler)


class _Pickler(cloudpickle.Pickler):
    # ForkingPickler's reductions (shared tensors, file descriptors) first, then cloudpickle's.
    dispatch_table = ChainMap(ForkingPickler._extra_reducers, cloudpickle.Pickler.dispatch_table)


def dumps(value) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getbuffer().tobytes()


def loads(data: bytes):
    return pickle.loads(data)


_NO_ROOM = ("tensor_parallel: the shared memory that the caller and its workers exchange tensors through "
            "(/dev/shm) is full: it must hold the model, and its parameters and gradients while the model lives. "
            "In a container, start it with a larger --shm-size (or --ipc=host), as PyTorch's DataLoader workers "
            "need too")


def add_note(error: BaseException, text: str) -> BaseException:
    """``error.add_note(text)`` (Python 3.11), or the text added to a one-string message before."""
    if hasattr(error, "add_note"):
        error.add_note(text)
    elif len(error.args) == 1 and isinstance(error.args[0], str):
        error.args = (f"{error.args[0]}\n{text}",)
    return error


def _with_hint(error: RuntimeError) -> RuntimeError:
    if "No space left on device" in str(error) or "unable to write to file" in str(error):
        add_note(error, _NO_ROOM)
    return error


def share_memory(tensor) -> None:
    """``tensor``'s storage moved to shared memory (where the caller maps it), with the fix named when
    there is no room."""
    try:
        tensor.share_memory_()
    except RuntimeError as error:
        raise _with_hint(error)


def send(connection, value) -> None:
    try:
        data = dumps(value)
    except RuntimeError as error:
        raise _with_hint(error)
    connection.send_bytes(data)


def receive(connection):
    return loads(connection.recv_bytes())
