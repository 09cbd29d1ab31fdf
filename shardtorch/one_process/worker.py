"""One device's rank, run by ``python -m shardtorch.one_process.worker`` from the caller's pool.

It joins the caller's store as one rank of a group of every device (torch.distributed, then
shardtorch's groups: the same init, ops, kernels and collectives as a rank that torchrun starts),
then answers the caller's commands in order until the caller closes or goes away. An exception in a
command goes back to the caller as the reply; the rank goes on to the next command.
"""
import ctypes
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import traceback


def _die_with_the_caller() -> None:
    """SIGKILL when the caller's process ends, however it ends (a rank stuck in a collective hears no
    closed pipe). Linux's PR_SET_PDEATHSIG; elsewhere the closed pipe is the only signal."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def _error_reply(error: BaseException) -> tuple:
    """("error", the exception if it pickles, its type's name, the formatted traceback)."""
    from . import wire
    text = "".join(traceback.format_exception(error))
    try:
        wire.loads(wire.dumps(error))
        picklable = error
    except Exception:
        picklable = None
    return ("error", picklable, type(error).__name__, text)


def main() -> None:
    address, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    # The caller's Ctrl-C is the caller's to handle (pool.py): a rank that stopped mid-collective
    # would leave its peers waiting.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_the_caller()
    authkey = bytes.fromhex(os.environ.pop("SHARDTORCH_ONE_PROCESS_KEY"))
    multiprocessing.current_process().authkey = authkey  # tensors' file descriptors come through it
    connection = multiprocessing.connection.Client(address, family="AF_UNIX", authkey=authkey)
    connection.send(rank)
    from . import wire
    from .rank_model import RankModel
    rank_model = None
    try:
        setup = wire.receive(connection)
        try:
            rank_model = RankModel(rank, world, **setup)
            wire.send(connection, ("ok", rank_model.describe()))
        except BaseException as error:
            wire.send(connection, _error_reply(error))
            return
        while True:
            try:
                command, payload = wire.receive(connection)
            except (EOFError, OSError):
                return  # the caller is gone
            if command == "close":
                wire.send(connection, ("ok", None))
                return
            try:
                reply = ("ok", rank_model.run(command, payload))
            except BaseException as error:
                reply = _error_reply(error)
            wire.send(connection, reply)
    finally:
        if rank_model is not None:
            rank_model.close()
        connection.close()


if __name__ == "__main__":
    main()
