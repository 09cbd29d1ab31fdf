"""The torchrun attempt handshake (shardtorch/distributed/elastic_store.py), run
by threads on one in-memory store: the ranks of an attempt agree on one id, keys
left by earlier attempts (their asks and answers) cannot fool them, whatever the
order in which the ranks arrive, and a missing rank 0 gives a clear error."""
import datetime
import random
import threading
import time

import pytest
import torch.distributed as dist

from shardtorch.distributed.elastic_store import _agree_on_attempt

TIMEOUT = datetime.timedelta(seconds=20)


def _attempt(store, world, delays):
    """Runs ranks 0..world-1 as threads, rank r starting after delays[r] s."""
    results, errors = [None] * world, []

    def rank_main(rank):
        time.sleep(delays[rank])
        try:
            results[rank] = _agree_on_attempt(store, rank, world, TIMEOUT)
        except Exception as error:  # surfaced by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    return results


@pytest.mark.parametrize("seed", range(6))
def test_each_attempt_agrees_on_a_new_id_despite_the_previous_attempts_keys(seed):
    rng = random.Random(seed)
    store = dist.HashStore()
    seen = set()
    # 4 ranks, then 3 after a node loss, then 3 again, then 4: each attempt
    # starts its ranks in a random order (rank 0 first or last included).
    for world in (4, 3, 3, 4):
        delays = [rng.choice([0.0, 0.05, 0.2]) for _ in range(world)]
        ids = _attempt(store, world, delays)
        assert len(set(ids)) == 1, f"ranks disagree: {ids}"
        assert ids[0] not in seen, "an attempt reused an earlier attempt's id"
        seen.add(ids[0])


def test_a_stale_answer_for_a_rank_is_not_taken():
    store = dist.HashStore()
    old = _attempt(store, 2, [0.0, 0.0])[0]
    # The new rank 1 arrives first, while the old ask and answer are still there.
    new = _attempt(store, 2, [0.3, 0.0])
    assert new[0] == new[1] != old


def test_world_of_one_needs_no_peer():
    assert _agree_on_attempt(dist.HashStore(), 0, 1, TIMEOUT)


def test_a_rank_without_rank_0_fails_clearly():
    with pytest.raises(TimeoutError, match="rank 1 of 2 got no answer from rank 0"):
        _agree_on_attempt(dist.HashStore(), 1, 2, datetime.timedelta(seconds=1))


def test_rank_0_without_peers_fails_clearly():
    with pytest.raises(TimeoutError, match=r"rank 0 of 3 waited .* for ranks \[1, 2\]"):
        _agree_on_attempt(dist.HashStore(), 0, 3, datetime.timedelta(seconds=1))
