"""Fork servers: processes started without paying for their imports.

Most of what starting a rank costs is importing: torch (about 2 s), torch._dynamo (1.6 s) and
transformers (1.2 s, more with a model's own module). A server imports them once and forks each
process from that state: a real process of its own (its own memory, its own sockets, its own exit
code and output), run as ``python -m MODULE ARGS`` or ``python SCRIPT ARGS`` would run it, with
those modules already loaded. Two users: the test harness's ranks (tests/fork_server.py) and the
worker processes of ``ts.tensor_parallel`` (one_process/pool.py); each configures its own
``ForkServers``.

What a fresh interpreter would do differently is kept out:
- Process r of every start forks from server r, and each server has its own hash seed: the ranks
  of a group iterate sets of strings in different orders, as fresh processes do (code that
  issues collectives in such an order fails here as it would under torchrun). ``random`` (and
  numpy's global generator) are reseeded from the OS in each process. With PYTHONHASHSEED set
  (the ranks would share it) every process starts by exec.
- A process's environment may differ from its server's only in the servers' runtime variables,
  which are read when used, never at import; anything else (MALLOC_* read by glibc at start-up,
  PYTHONWARNINGS, a variable set since the servers started) makes ``spawn`` return None and the
  caller start the process with exec.
- A server never runs torch code, so no OpenMP thread pool exists when it forks (forking a process
  that has used OpenMP hangs the child's first parallel region): it only imports.
- The servers' switch variable set to "0" turns them off (every process by exec).

On the 2-core VM of benchmarks/results/build.md, tests/distributed and tests/compat took 494 s with
every rank exec'd and 303 s with the servers (the same 423 tests).

Protocol (a Unix socket per server): the client sends one JSON request and the write end of its
output pipe (SCM_RIGHTS); the server forks a supervisor, which forks the process, sends its pid,
waits for it and sends its exit status (Popen's convention: -N for signal N). The supervisor
kills the process when the client asks or goes away, before reaping it, so a kill cannot reach a
process that reused the pid and none outlives its client. The server stays single-threaded, so
forking from it is safe; it exits when its parent does. Only the standard library at module level:
the server imports what it preloads in main().
"""
import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

#: Read when used, never at import: variables in which every user's processes may differ from their
#: server's (a rank's place in its group, shardtorch's runtime settings).
RUNTIME_VARIABLES = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "SHARDTORCH_TIMEOUT", "SHARDTORCH_DEBUG", "SHARDTORCH_ON_COMM_FAILURE", "SHARDTORCH_SHARED_MEMORY",
    "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",  # set in the client by inductor's first use
})


def _possible() -> bool:
    return hasattr(os, "fork") and hasattr(socket, "send_fds")


# ----------------------------------------------------------------------------- the client side

def _readable(fd: int, deadline: Optional[float]) -> bool:
    """Whether ``fd`` has data (or EOF) before ``deadline`` (None: wait for it)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    return bool(poller.poll(None if left is None else int(left * 1000)))


class ForkedRank:
    """The parts of subprocess.Popen that tests/launcher.py's wait_ranks uses, for a rank forked
    by a server: communicate, poll, kill, wait, returncode, pid. The rank's supervisor holds it
    unreaped until it has sent its status, and kills it when asked or when this end closes, so
    a kill never reaches another process that reused the pid."""

    def __init__(self, connection: socket.socket, output: Optional[int]):
        self._connection, self._output, self._captured = connection, output, output is not None
        self._buffer, self._chunks = b"", []
        self.returncode: Optional[int] = None
        self.pid = int(self._message(time.monotonic() + 120)["pid"])

    def _message(self, deadline: Optional[float]) -> dict:
        while b"\n" not in self._buffer:
            if not _readable(self._connection.fileno(), deadline):
                raise subprocess.TimeoutExpired("forked rank", 0)
            data = self._connection.recv(4096)
            if not data:
                raise EOFError("the fork server's supervisor of this rank vanished")
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def _wait(self, deadline: Optional[float]) -> int:
        if self.returncode is None:
            try:
                self.returncode = int(self._message(deadline)["status"])
            except EOFError as error:  # no status will come: say so, never raise in cleanup
                self.returncode = 1
                self._chunks.append(f"\n[shardtorch fork server: {error}; its exit status is unknown]\n".encode())
            self._connection.close()
        return self.returncode

    def _read_output(self, deadline: Optional[float]) -> None:
        while self._output is not None:
            if not _readable(self._output, deadline):
                raise subprocess.TimeoutExpired("forked rank", 0)
            data = os.read(self._output, 1 << 16)
            if data:
                self._chunks.append(data)
            else:
                self._close_output()

    def _close_output(self) -> None:
        if self._output is not None:
            os.close(self._output)
            self._output = None

    def communicate(self, timeout: Optional[float] = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        self._read_output(deadline)
        self._wait(deadline)
        if not self._captured:
            return None, None
        text = b"".join(self._chunks).decode("utf-8", "replace")
        return text.replace("\r\n", "\n").replace("\r", "\n"), None

    def poll(self) -> Optional[int]:
        try:
            return self._wait(time.monotonic())
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.returncode is None:
            try:
                self._connection.sendall(b"kill\n")
            except OSError:
                pass

    def wait(self, timeout: Optional[float] = None) -> int:
        code = self._wait(None if timeout is None else time.monotonic() + timeout)
        self._close_output()
        return code


class _Server:
    def __init__(self, index: int, env: Dict[str, str], cwd: str, preload: List[str], optional: List[str]):
        self.path = os.path.join(tempfile.mkdtemp(prefix="shardtorch-fork-"), "socket")
        # A session of its own: a terminal's Ctrl-C goes to the client, which decides what stops.
        self.process = subprocess.Popen([sys.executable, "-m", "shardtorch.utils.fork_server", self.path,
                                         ",".join(preload), ",".join(optional)], env=env, cwd=cwd,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        self.index, self.ready = index, None

    def wait_ready(self, timeout: float = 300) -> bool:
        """Whether the server imported everything and listens; the lines it printed before (an
        import's warnings) are skipped, an error or a silence of ``timeout`` seconds means no."""
        if self.ready is None:
            deadline, said = time.monotonic() + timeout, b""
            fd = self.process.stdout.fileno()
            while self.ready is None:
                data = os.read(fd, 1 << 16) if _readable(fd, deadline) else None
                said += data or b""
                if b"\nready\n" in b"\n" + said:
                    self.ready = True
                elif not data:  # EOF (it died) or the deadline
                    self.ready = False
                    self.close()
                    sys.stderr.write(f"shardtorch fork server {self.index} did not start; processes start "
                                     f"by exec:\n{said[-2000:].decode('utf-8', 'replace')}\n")
        return self.ready

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for remove, path in ((os.unlink, self.path), (os.rmdir, os.path.dirname(self.path))):
            try:
                remove(path)
            except OSError:
                pass


def _command_target(command: List[str]) -> Optional[dict]:
    if len(command) < 2 or command[0] != sys.executable:
        return None
    if command[1] == "-m" and len(command) >= 3:
        return {"module": command[2], "argv": [command[2], *command[3:]]}
    if command[1].endswith(".py") and os.path.isfile(command[1]):
        return {"script": os.path.abspath(command[1]), "argv": command[1:]}
    return None


def _output_fds() -> List[int]:
    """Where this process's standard output and error go, as descriptors (1 and 2 where sys.stdout
    has none, as in a notebook's kernel)."""
    fds = []
    for stream, default in ((sys.stdout, 1), (sys.stderr, 2)):
        try:
            fds.append(stream.fileno())
        except (AttributeError, OSError, ValueError):
            fds.append(default)
    return fds


class ForkServers:
    """One server per process index, started at the first ``spawn``, for processes whose environment
    is ``session_env()`` (less the runtime variables) in ``cwd``.

    Args:
        preload: modules every server imports (an ImportError there: the server does not start and
            every process starts by exec).
        optional_preload: modules imported where installed.
        runtime_variables: variables (beyond RUNTIME_VARIABLES) in which a process's environment may
            differ from its server's.
        session_env: the environment the servers run with (called at the first spawn); None: the
            first process's own.
        session_cwd: their directory; None: the first process's.
        switch: the variable that turns the servers off when "0".
    """

    def __init__(self, preload, optional_preload=(), runtime_variables=(), session_env=None, session_cwd=None,
                 switch: str = "SHARDTORCH_FORK_SERVER"):
        self.preload, self.optional_preload = list(preload), list(optional_preload)
        self.runtime_variables = RUNTIME_VARIABLES | frozenset(runtime_variables)
        self._session_env, self._session_cwd, self.switch = session_env, session_cwd, switch
        self._servers: Dict[int, _Server] = {}
        self._session: Optional[tuple] = None  # (environment less the runtime variables, directory)
        self._told: set = set()  # the sets of differing variables already reported
        atexit.register(self.close)

    def enabled(self) -> bool:
        return os.environ.get(self.switch, "1") != "0" and _possible()

    def _base(self, env: Dict[str, str]) -> Dict[str, str]:
        return {k: v for k, v in env.items() if k not in self.runtime_variables}

    def spawn(self, command: List[str], env: Dict[str, str], cwd: str, capture: bool) -> Optional[ForkedRank]:
        """A ForkedRank running ``command`` (``[sys.executable, "-m", module, ...]`` or
        ``[sys.executable, script.py, ...]``) as process ``env["RANK"]`` of ``env["WORLD_SIZE"]``, or
        None when it must start by exec: servers off, another command, PYTHONHASHSEED set (the
        processes would not share it), or an environment that differs from the servers' in more than
        the runtime variables. ``capture``: its output comes back through ``communicate``; otherwise
        it writes to this process's standard output and error."""
        if not self.enabled() or "RANK" not in env or "PYTHONHASHSEED" in env:
            return None
        target = _command_target(command)
        if target is None:
            return None
        if self._session is None:
            self._session = (self._base(self._session_env() if self._session_env else env),
                             os.path.abspath(self._session_cwd() if self._session_cwd else cwd))
        base = self._base(env)
        if (base, os.path.abspath(cwd)) != self._session:
            differ = sorted(k for k in set(base) | set(self._session[0]) if base.get(k) != self._session[0].get(k))
            if tuple(differ) not in self._told:  # once per set of variables
                self._told.add(tuple(differ))
                sys.stderr.write(f"shardtorch fork servers: processes start by exec: their environment differs "
                                 f"from the servers' in {differ or ['the directory']}\n")
            return None
        index = int(env["RANK"])
        launch = range(max(index + 1, int(env.get("WORLD_SIZE", "1"))))
        # Every process of the start forks or none does, and all at once: start the missing servers
        # together and wait for all, so no process waits for a server's imports while its peers run.
        for other in launch:
            if other not in self._servers:
                self._servers[other] = _Server(other, *self._session, self.preload, self.optional_preload)
        if not all(self._servers[other].wait_ready() for other in launch):
            return None
        server = self._servers[index]
        read, write = os.pipe() if capture else (None, None)
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect(server.path)
            fds = [write] if capture else _output_fds()
            payload = json.dumps(dict(target, env=env, cwd=cwd)).encode() + b"\n"
            sent = socket.send_fds(connection, [payload], fds)
            connection.sendall(payload[sent:])
            rank = ForkedRank(connection, read)
        except (OSError, EOFError, subprocess.TimeoutExpired) as error:
            connection.close()  # a process forked late is killed by its supervisor when this closes
            if read is not None:
                os.close(read)
            sys.stderr.write(f"shardtorch fork server {index} failed ({error!r}); processes start by exec\n")
            server.ready = False
            return None
        finally:
            if write is not None:
                os.close(write)
        return rank

    def close(self) -> None:
        for server in self._servers.values():
            server.close()
        self._servers.clear()


# ----------------------------------------------------------------------------- the server side

def _child(request: dict, fds: List[int]) -> None:
    """In the forked rank: its descriptors, directory, environment, argv and path, as exec would
    have set them; returns to main(), which runs the target."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    out, err = (fds[0], fds[0]) if len(fds) == 1 else fds
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = list(request["argv"])
    if "script" in request:  # python SCRIPT puts the script's folder first on the path, -m the directory
        sys.path[0] = os.path.dirname(request["script"])
    else:
        sys.path[0] = os.getcwd()
    import random
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _serve(path: str) -> dict:
    """Accepts requests until the parent exits; returns (in the forked rank only) its request."""
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    print("ready", flush=True)
    # Nothing more to say: a full pipe nobody reads must never stall the server.
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)
    while True:
        if not select.select([listener], [], [], 1.0)[0]:
            if os.getppid() != parent:
                sys.exit(0)
            continue
        connection, fds = None, []
        try:
            connection, _ = listener.accept()
            data, fds, _, _ = socket.recv_fds(connection, 1 << 20, 2)
            while data and not data.endswith(b"\n"):
                more = connection.recv(1 << 20)
                if not more:
                    break
                data += more
            request = json.loads(data)
            sys.stdout.flush()
            sys.stderr.flush()
            supervisor = os.fork()
        except (OSError, ValueError):  # a client gone mid-request, or no fork now: the client execs
            supervisor = -1
        if supervisor != 0:  # the server: on to the next request
            for fd in fds:
                os.close(fd)
            if connection is not None:
                connection.close()
            continue
        listener.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        rank = os.fork()
        if rank == 0:
            connection.close()
            _child(request, fds)
            return request
        for fd in fds:
            os.close(fd)
        _supervise(rank, connection)


def _supervise(rank: int, connection: socket.socket) -> None:
    """In the supervisor: sends the rank's pid, kills it when the client asks ("kill") or goes
    away (pytest killed, a timeout), reaps it only then or when it exits by itself, sends its
    exit status, exits. Until it is reaped its pid is its own, so the kill cannot miss."""
    try:
        try:
            connection.sendall(json.dumps({"pid": rank}).encode() + b"\n")
        except OSError:
            os.kill(rank, signal.SIGKILL)
        killed = False
        while True:
            done, status = os.waitpid(rank, os.WNOHANG)
            if done:
                break
            if not killed and _readable(connection.fileno(), time.monotonic() + 0.05):
                try:
                    connection.recv(64)  # "kill", or EOF: the client will read no more either way
                except OSError:
                    pass
                os.kill(rank, signal.SIGKILL)
                killed = True
            elif killed:
                time.sleep(0.01)
        try:
            connection.sendall(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        except OSError:
            pass
    finally:
        os._exit(0)


def main() -> None:
    import importlib
    for name in filter(None, sys.argv[2].split(",")):
        importlib.import_module(name)
    for name in filter(None, sys.argv[3].split(",")):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    import gc
    gc.freeze()  # the preloaded objects: never scanned by a rank's collector, so their pages stay shared
    request = _serve(sys.argv[1])
    import runpy
    if "script" in request:
        runpy.run_path(request["script"], run_name="__main__")
    else:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
