"""Each rank serves its vocabulary shards of the lazy logits (lazy_logits.py) to its peers, so that a
rank reads the whole logits without the other ranks taking part.

Why not a collective: a collective needs every rank of the group at the same point, and a read of the
logits is user code that may run on one rank only (``if rank == 0: print(out.logits.argmax(-1))``).
Its peers would never join, and the next collective they do call (the next forward's) would meet the
reader's gather instead. Here a background thread per rank answers requests on a Unix socket (Linux's
abstract namespace: nothing on disk, gone with the process): "the shard of lazy output number n". The
ranks of a group number their lazy outputs alike (every rank runs the same forwards), so n names the
same output on every rank. A peer that has not made output n yet (it can be a little behind after the
forward's last collective) is waited for.

How long a shard is kept: while any rank of the group may still read output n, that is while its own
output lives (a rank that read it holds the whole and needs no shard). Each rank tells its peers when
its output n is freed, so a rank that has moved on still serves a slower reader, and in a step that
reads only the loss every rank frees the shard as soon as every rank has dropped the output: nothing is
kept beyond what the outputs themselves hold.

The ranks must share a host (Unix sockets); ``service_for`` returns None otherwise, and the logits are
gathered eagerly instead.
"""
import queue
import socket
import struct
import threading
import uuid
import weakref
from typing import Dict, List, Optional, Set

import torch
import torch.distributed as dist

from ...distributed import collectives
from ...distributed import state

_REQUEST = struct.Struct("<qqq")  # (what, output number, the asking group rank)
_FETCH, _FREED = 0, 1
_HEADER = struct.Struct("<qq")  # (status, number of dimensions)
_FOUND, _GONE = 0, -1


class _Kept:
    """This rank's shard of one output, and who may still read it."""
    __slots__ = ("shard", "own_output_alive", "readers")

    def __init__(self, shard: torch.Tensor, readers: Set[int]) -> None:
        self.shard, self.own_output_alive, self.readers = shard, True, readers


class ShardService:
    """This rank's server and its peers' addresses for one group."""

    def __init__(self, group: str, addresses: List[str], rank: int, listener: socket.socket,
                 timeout: float) -> None:
        self.group, self.addresses, self.rank, self.timeout = group, addresses, rank, timeout
        self._peers = set(range(len(addresses))) - {rank}
        self._listener = listener
        self._kept: Dict[int, _Kept] = {}
        self._freed_early: Dict[int, Set[int]] = {}  # peers that freed an output this rank has yet to make
        self._made = 0  # how many lazy outputs this rank has made
        self._changed = threading.Condition()  # an RLock: a weakref callback may fire while it is held
        self._freed = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=f"shardtorch-logits-{group}", daemon=True).start()
        threading.Thread(target=self._announce_freed, name=f"shardtorch-logits-freed-{group}",
                         daemon=True).start()

    def register(self, holder) -> int:
        """Numbers ``holder`` (this rank's lazy output, with ``shard``); its shard is kept for the peers
        while ``holder`` lives, then until every peer has read or freed the same output."""
        with self._changed:
            self._made += 1
            number = self._made
            readers = self._peers - self._freed_early.pop(number, set())
            self._kept[number] = _Kept(holder.shard, readers)
            weakref.finalize(holder, self._own_output_freed, number).atexit = False
            self._changed.notify_all()
        return number

    def _own_output_freed(self, number: int) -> None:
        with self._changed:
            kept = self._kept.get(number)
            if kept is not None:
                kept.own_output_alive = False
                self._release_if_done(number)
        self._freed.put(number)

    def _done_with(self, number: int, peer: int) -> None:
        with self._changed:
            kept = self._kept.get(number)
            if kept is None:
                if number > self._made:
                    self._freed_early.setdefault(number, set()).add(peer)
                return
            kept.readers.discard(peer)
            self._release_if_done(number)

    def _release_if_done(self, number: int) -> None:
        kept = self._kept[number]
        if not kept.own_output_alive and not kept.readers:
            del self._kept[number]

    def fetch(self, peer: int, number: int) -> Optional[torch.Tensor]:
        """Group rank ``peer``'s shard of lazy output ``number`` (on the CPU), or None if it is gone."""
        with self._connect(peer) as connection:
            connection.sendall(_REQUEST.pack(_FETCH, number, self.rank))
            status, ndim = _HEADER.unpack(_receive(connection, _HEADER.size))
            if status == _GONE:
                return None
            shape = struct.unpack(f"<{ndim}q", _receive(connection, 8 * ndim))
            dtype = getattr(torch, _receive(connection, 32).rstrip(b"\0").decode().split(".")[-1])
            shard = torch.empty(shape, dtype=dtype)
            _receive_into(connection, shard.view(-1).view(torch.uint8).numpy())
            return shard

    def _connect(self, peer: int) -> socket.socket:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.settimeout(self.timeout)
        try:
            connection.connect(self.addresses[peer])
        except OSError as error:
            connection.close()
            raise RuntimeError(f"lazy logits: group rank {peer} of group {self.group!r} does not answer "
                               f"({error}); has its process exited?") from None
        return connection

    def _announce_freed(self) -> None:
        while True:
            number = self._freed.get()
            for peer in self._peers:
                try:
                    with self._connect(peer) as connection:
                        connection.sendall(_REQUEST.pack(_FREED, number, self.rank))
                except (OSError, RuntimeError):
                    pass  # the peer has exited: nobody left to read

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return  # closed
            with connection:
                try:
                    self._answer(connection)
                except OSError:
                    pass  # the reader went away; it raises on its side

    def _answer(self, connection: socket.socket) -> None:
        what, number, peer = _REQUEST.unpack(_receive(connection, _REQUEST.size))
        if what == _FREED:
            self._done_with(number, peer)
            return
        with self._changed:  # a peer may ask for an output this rank is about to make
            self._changed.wait_for(lambda: self._made >= number, timeout=self.timeout)
            kept = self._kept.get(number)
            shard = kept.shard if kept is not None else None
        if shard is None:
            connection.sendall(_HEADER.pack(_GONE, 0))
            return
        shard = shard.detach().to("cpu").contiguous()
        connection.sendall(_HEADER.pack(_FOUND, shard.dim()))
        connection.sendall(struct.pack(f"<{shard.dim()}q", *shard.shape))
        connection.sendall(str(shard.dtype).encode().ljust(32, b"\0"))
        connection.sendall(shard.view(-1).view(torch.uint8).numpy().data)
        self._done_with(number, peer)  # it holds the whole now


def _receive(connection: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    _receive_into(connection, memoryview(buffer))
    return bytes(buffer)


def _receive_into(connection: socket.socket, buffer) -> None:
    view, done = memoryview(buffer).cast("B"), 0
    while done < len(view):
        got = connection.recv_into(view[done:])
        if got == 0:
            raise RuntimeError("lazy logits: a peer closed the connection before sending its shard")
        done += got


_SERVICES: Dict[str, Optional[ShardService]] = {}


def service_for(group: str) -> Optional[ShardService]:
    """The service of ``group``, started on first use (a collective: every rank of the group calls it at
    the same point, in parallelize); None when the group's ranks are not all on this host."""
    process_group = state.get_group(group)
    key = f"{group}/{process_group.group_name}"  # a group made again after destroy_process_group is new
    if key not in _SERVICES:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address = f"\0shardtorch-logits-{uuid.uuid4().hex}"
        listener.bind(address)
        listener.listen(64)
        mine = (socket.gethostname(), _boot_id(), address)
        everyone = [None] * dist.get_world_size(process_group)
        collectives.all_gather_object(everyone, mine, group=process_group)
        if len({(host, boot) for host, boot, _ in everyone}) != 1:
            listener.close()
            _SERVICES[key] = None
        else:
            timeout = state.default_timeout().total_seconds()
            _SERVICES[key] = ShardService(group, [a for _, _, a in everyone], dist.get_rank(process_group),
                                          listener, timeout)
    return _SERVICES[key]


def _boot_id() -> str:
    """Tells hosts apart where containers share a host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""
