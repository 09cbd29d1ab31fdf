"""The caller's side of the workers: starting one process per device, sending each command to every
rank, and turning what goes wrong on a rank into an exception here.

Faults: when a rank raises, the others get ``grace_s`` to answer. If every rank answered (each
raised, or finished), no collective is left waiting and the pool stays usable: the first rank's
error is raised here. If a rank did not answer (its peers wait in a collective it never joins) or
a rank's process ended, every worker is stopped, the pool is marked broken and the error says
that the model must be rebuilt. Ctrl-C while the ranks work asks a running ``generate`` to stop
at the next token (every rank at the same one) and waits up to ``grace_s`` for the command to end;
then the pool is usable and KeyboardInterrupt is raised. A second Ctrl-C, or a command that does
not end in time, stops the workers (the model must be rebuilt).
"""
import datetime
import multiprocessing
import multiprocessing.connection
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from ..utils.fork_server import ForkServers
from . import wire

# The workers' fork servers: what every worker imports, once per caller (the first model pays it).
_SERVERS = ForkServers(preload=("torch", "torch.distributed", "shardtorch", "shardtorch.one_process.rank_model"),
                       optional_preload=("transformers", "transformers.modeling_utils", "transformers.generation"),
                       # pytest names each test in the environment: models built in a test suite still fork.
                       runtime_variables=("SHARDTORCH_ONE_PROCESS_KEY", "PYTEST_CURRENT_TEST"))


_POLL_S = 0.2


class WorkerError(RuntimeError):
    """A rank's exception that could not be sent back as itself."""


class BrokenModelError(RuntimeError):
    """The workers were stopped (a rank failed alone, exited, or the caller interrupted them); the
    model must be built again."""


def _pidfd(pid: int) -> Optional[int]:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


class WorkerPool:
    def __init__(self, devices: Sequence[torch.device], threads: int, build: dict, timeout_s: float,
                 grace_s: float, start_timeout_s: float = 300.0):
        self.devices = list(devices)
        self.grace_s = grace_s
        self.broken: Optional[str] = None
        self.closed = False
        self.stop_flag = torch.zeros(1, dtype=torch.int32).share_memory_()
        authkey = secrets.token_bytes(32)
        # Tensors' file descriptors come back through multiprocessing's resource sharer, which checks
        # this process's key: the workers are given the same one.
        multiprocessing.current_process().authkey = multiprocessing.current_process().authkey or authkey
        authkey = multiprocessing.current_process().authkey
        self._folder = tempfile.mkdtemp(prefix="shardtorch-one-process-")
        address = os.path.join(self._folder, "caller")
        listener = multiprocessing.connection.Listener(address, family="AF_UNIX", authkey=authkey)
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        env = dict(os.environ, SHARDTORCH_ONE_PROCESS_KEY=authkey.hex())
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                     "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = package_root + os.pathsep + env.get("PYTHONPATH", "")
        self.processes = []
        self.connections: List[Optional[multiprocessing.connection.Connection]] = []
        try:
            for rank in range(len(self.devices)):
                command = [sys.executable, "-m", "shardtorch.one_process.worker", address, str(rank),
                           str(len(self.devices))]
                rank_env = dict(env, RANK=str(rank), WORLD_SIZE=str(len(self.devices)))
                # Forked from a server that has imported torch, shardtorch and transformers already
                # (utils/fork_server.py), else a fresh interpreter.
                process = _SERVERS.spawn(command, rank_env, os.getcwd(), capture=False)
                self.processes.append(process or subprocess.Popen(command, env=rank_env, start_new_session=True))
            self._pidfds = [_pidfd(p.pid) for p in self.processes]
            self.connections = self._accept(listener, start_timeout_s)
            for rank, connection in enumerate(self.connections):
                wire.send(connection, dict(store_port=self._store.port, device=str(self.devices[rank]),
                                           threads=threads, build=build, stop_flag=self.stop_flag,
                                           timeout_s=timeout_s))
            self.run_setup()
        except BaseException:
            listener.close()
            self.stop()
            raise
        listener.close()

    def _accept(self, listener, timeout_s: float):
        """One connection per rank, in rank order (each worker says its rank first)."""
        connections = [None] * len(self.processes)
        deadline = time.monotonic() + timeout_s
        listener._listener._socket.settimeout(1.0)
        accepted = 0
        while accepted < len(self.processes):
            for rank, process in enumerate(self.processes):
                if process.poll() is not None and connections[rank] is None:
                    raise RuntimeError(f"tensor_parallel: the worker of rank {rank} ({self.devices[rank]}) exited "
                                       f"with code {process.returncode} while starting (its output is above)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor_parallel: the workers did not start within {timeout_s:.0f} s")
            try:
                connection = listener.accept()
            except (TimeoutError, OSError):
                continue
            rank = connection.recv()
            connections[rank] = connection
            accepted += 1
        return connections

    def run_setup(self):
        self.described = self._collect(range(len(self.connections)), "starting")

    # -- commands -------------------------------------------------------------------------------
    def check_usable(self) -> None:
        if self.closed:
            raise BrokenModelError("tensor_parallel: this model was closed; its workers are gone. Build it again")
        if self.broken:
            raise BrokenModelError(self.broken)

    def run(self, command: str, payloads, ranks: Optional[Sequence[int]] = None) -> list:
        """Sends ``command`` to ``ranks`` (all by default), with ``payloads`` (one dict for all, or a
        list per rank), and returns every rank's result in rank order."""
        self.check_usable()
        ranks = list(range(len(self.connections))) if ranks is None else list(ranks)
        for rank in ranks:
            payload = payloads[rank] if isinstance(payloads, list) else payloads
            wire.send(self.connections[rank], (command, dict(payload)))
        return self._collect(ranks, command)

    def _collect(self, ranks, command: str) -> list:
        results, errors = {}, {}
        waiting = {self.connections[r]: r for r in ranks}
        sentinels = {fd: r for r, fd in enumerate(self._pidfds) if fd is not None and r in ranks}
        first_error_at = interrupted_at = None
        try:
            while waiting:
                try:
                    limit = None
                    for started in (first_error_at, interrupted_at):
                        if started is not None:
                            left = started + self.grace_s - time.monotonic()
                            limit = left if limit is None else min(limit, left)
                    if limit is not None and limit <= 0:
                        break
                    # Woken at least every _POLL_S: a Ctrl-C delivered to another thread of this process
                    # (a notebook's) is seen by this one only between two Python steps.
                    ready = multiprocessing.connection.wait(list(waiting) + list(sentinels),
                                                            timeout=_POLL_S if limit is None else min(limit, _POLL_S))
                    for item in ready:
                        if item in sentinels:
                            rank = sentinels.pop(item)
                            if self.connections[rank] in waiting and not self.connections[rank].poll():
                                self._exited(rank, command)
                            continue
                        rank = waiting.pop(item)
                        try:
                            reply = wire.receive(item)
                        except (EOFError, OSError):
                            self._exited(rank, command)
                        if reply[0] == "ok":
                            results[rank] = reply[1]
                        else:
                            errors[rank] = reply
                            first_error_at = first_error_at or time.monotonic()
                except KeyboardInterrupt:
                    if interrupted_at is not None:
                        self._break("tensor_parallel: the workers were stopped by a second interrupt during "
                                    f"{command}; the model must be built again")
                        raise
                    interrupted_at = time.monotonic()
                    self.stop_flag.fill_(1)
            if waiting:
                if errors:
                    rank = min(errors)
                    self._break(f"tensor_parallel: rank {rank} ({self.devices[rank]}) raised during {command} while "
                                f"rank(s) {sorted(waiting.values())} went on (they wait in a collective it left); "
                                "every worker was stopped and the model must be built again")
                    raise self._error(rank, errors[rank], command, broken=True)
                self._break(f"tensor_parallel: an interrupt during {command} did not end within {self.grace_s} s; "
                            "the workers were stopped and the model must be built again")
                raise KeyboardInterrupt
        finally:
            self.stop_flag.fill_(0)
        if errors:
            rank = min(errors)
            raise self._error(rank, errors[rank], command, broken=False)
        if interrupted_at is not None:
            raise KeyboardInterrupt
        return [results[r] for r in ranks]

    def _exited(self, rank: int, command: str) -> None:
        try:
            code = self.processes[rank].wait(timeout=self.grace_s)
        except subprocess.TimeoutExpired:
            code = "unknown: it closed its pipe"
        self._break(f"tensor_parallel: the worker of rank {rank} ({self.devices[rank]}) exited (code {code}) during "
                    f"{command}; every worker was stopped and the model must be built again")
        raise BrokenModelError(self.broken)

    def _error(self, rank: int, reply, command: str, broken: bool) -> BaseException:
        _, error, type_name, text = reply
        where = f"raised on rank {rank} ({self.devices[rank]}) during {command}"
        if broken:
            where += f"; {self.broken}"
        if error is None:
            return WorkerError(f"{type_name} {where}:\n{text}")
        return wire.add_note(error, f"shardtorch.tensor_parallel: {where}. The rank's traceback:\n{text}")

    def _break(self, reason: str) -> None:
        self.broken = reason
        self.stop()

    def stop(self) -> None:
        """Ends every worker now (SIGKILL: a rank may wait in a collective) and frees what they held."""
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            process.wait()
        self._release()

    def close(self, timeout_s: float = 30.0) -> None:
        """Asks each worker to leave its groups and exit; stops any that does not."""
        if self.closed:
            return
        self.closed = True
        if not self.broken:
            for connection in self.connections:
                try:
                    wire.send(connection, ("close", {}))
                except OSError:
                    pass
            deadline = time.monotonic() + timeout_s
            for process in self.processes:
                try:
                    process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        self.stop()

    def _release(self) -> None:
        for connection in self.connections:
            if connection is not None:
                connection.close()
        self.connections = [None] * len(self.connections)
        for fd in getattr(self, "_pidfds", ()):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._pidfds = []
        shutil.rmtree(self._folder, ignore_errors=True)
