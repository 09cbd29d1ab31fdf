"""The store the workers of one torchrun attempt rendezvous in.

torchrun's agent serves one TCPStore for the whole run (TORCHELASTIC_USE_AGENT_STORE),
so after a restart the keys of the previous attempt (the dead ranks' addresses)
are still there, and a new worker that reads them connects to nobody. The
attempt therefore needs a key prefix of its own, agreed by its workers.

TORCHELASTIC_RESTART_COUNT cannot be that prefix: each agent counts its own
restarts, and after a node loss the survivors' counts differ (an agent whose
workers failed counts a restart, one that restarts because another node is
waiting does not), so workers of one attempt would wait in different key spaces
until the timeout. Instead rank 0 draws a fresh random id and hands it to every
other rank in a handshake that stale keys cannot satisfy: rank r asks with a
fresh random nonce and waits for the answer under a key that names that nonce,
so only the live rank 0 can answer it. This relies on what torchrun guarantees:
a new attempt's workers start after all workers of the previous attempt have
been stopped, so no stale rank 0 is left to answer.
"""
import datetime
import os
import time
import uuid
from typing import Optional

import torch.distributed as dist

_PREFIX = "shardtorch/elastic"
_POLL_SECONDS = 0.02


def elastic_store(timeout: datetime.timedelta) -> Optional[dist.Store]:
    """Under torchrun with the agent's store, that store scoped to this attempt;
    otherwise None (torch's env:// rendezvous is used as is)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False, timeout=timeout)
    attempt = _agree_on_attempt(store, rank, world, timeout)
    return dist.PrefixStore(f"shardtorch/attempt_{attempt}", store)


def _agree_on_attempt(store: dist.Store, rank: int, world: int, timeout: datetime.timedelta) -> str:
    if rank != 0:
        nonce = uuid.uuid4().hex
        store.set(f"{_PREFIX}/ask/{rank}", nonce)
        answer = f"{_PREFIX}/answer/{rank}/{nonce}"
        try:
            store.wait([answer], timeout)
        except Exception as error:  # torch raises DistStoreError or RuntimeError
            raise TimeoutError(f"shardtorch: rank {rank} of {world} got no answer from rank 0 within "
                               f"{timeout} while joining the torchrun attempt ({error})") from error
        attempt = store.get(answer).decode()
        store.set(f"{_PREFIX}/joined/{attempt}/{rank}", "1")
        return attempt

    # Rank 0 answers every ask it sees (stale asks too: nobody waits for those
    # answers) until each rank has confirmed this attempt's id.
    attempt = uuid.uuid4().hex
    answered = {}
    waiting = set(range(1, world))
    deadline = time.monotonic() + timeout.total_seconds()
    while waiting:
        for peer in sorted(waiting):
            ask = f"{_PREFIX}/ask/{peer}"
            if store.check([ask]):
                nonce = store.get(ask).decode()
                if answered.get(peer) != nonce:
                    store.set(f"{_PREFIX}/answer/{peer}/{nonce}", attempt)
                    answered[peer] = nonce
            if store.check([f"{_PREFIX}/joined/{attempt}/{peer}"]):
                waiting.discard(peer)
        if waiting:
            if time.monotonic() > deadline:
                raise TimeoutError(f"shardtorch: rank 0 of {world} waited {timeout} for ranks "
                                   f"{sorted(waiting)} to join the torchrun attempt")
            time.sleep(_POLL_SECONDS)
    return attempt
