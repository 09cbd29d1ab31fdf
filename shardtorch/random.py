"""Random numbers in tensor-parallel regions (``ts.random``): dropout on
sharded activations must draw different masks on different shards, dropout on
replicated activations the same mask on every rank of a group.

Two streams, on the CPU generator and on every CUDA device's generator alike:

- the default stream (torch's default generators), seeded with ``seed`` on
  every rank: use it for replicated tensors (the backbone in the 2-D layout,
  the gathered batch in the hybrid layout), whose masks must agree across the
  tensor-parallel group;
- the "model-parallel" stream, kept by an ``RNGStatesTracker`` and entered with
  ``ts.random.fork()``, seeded with ``seed + 2718 + tensor-parallel rank``: use
  it for sharded tensors. Shard r of every data-parallel replica draws the
  same stream, so data-parallel peers holding the same shard agree, and the
  shards of one group differ. The offset 2718 (Megatron-LM's choice) keeps the
  model-parallel seeds apart from the default seed of the same run.

    ts.random.model_parallel_seed(1234)
    h = column_parallel(x)               # sharded on its last dim
    with ts.random.fork():
        h = torch.nn.functional.dropout(h, 0.1)

fork() swaps the default generators' states with the tracked ones and back,
so the default stream does not advance inside it. With activation
checkpointing, pass ``context_fn=ts.random.checkpoint_context_fn`` to
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` (or call
``ts.random.checkpoint``), so that the recompute replays the tracked streams
from where the forward drew them (torch restores only the default streams).
"""
import contextlib
from typing import Dict, Iterator, List, Tuple

import torch
import torch.utils.checkpoint

MODEL_PARALLEL = "model-parallel"
MODEL_PARALLEL_SEED_OFFSET = 2718

States = Dict[str, List[torch.Tensor]]


def default_state_digest() -> int:
    """A digest of every default generator's state: equal where a checkpointed region's recompute
    restored the state its forward saw (torch.utils.checkpoint's preserve_rng_state)."""
    return hash(tuple(bytes(g.get_state().numpy()) for g in _generators()))


def _generators() -> List[torch.Generator]:
    """The default generators a fork swaps: the CPU one, then one per CUDA
    device (CUDA is initialised so that every device's generator exists)."""
    generators = [torch.default_generator]
    if torch.cuda.is_available():
        torch.cuda.init()
        generators.extend(torch.cuda.default_generators)
    return generators


class RNGStatesTracker:
    """Named random streams, each a saved state of every default generator
    (CPU and CUDA), entered with ``fork(name)``."""

    def __init__(self) -> None:
        self._states: States = {}
        self._seeds: Dict[str, int] = {}

    def reset(self) -> None:
        self._states, self._seeds = {}, {}

    def names(self) -> List[str]:
        return list(self._states)

    def get_states(self) -> States:
        """A copy of every stream's state (for checkpointing and recompute)."""
        return {name: [s.clone() for s in states] for name, states in self._states.items()}

    def set_states(self, states: States) -> None:
        """Replaces every stream's state (from get_states)."""
        self._states = {name: [s.clone() for s in saved] for name, saved in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Creates the stream ``name`` seeded with ``seed`` on every generator."""
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"RNGStatesTracker.add: seed must be an int, got {seed!r}")
        if name in self._states:
            raise ValueError(f"RNGStatesTracker.add: stream {name!r} exists already; reset() first")
        if seed in self._seeds.values():
            raise ValueError(f"RNGStatesTracker.add: seed {seed} is already used by stream "
                             f"{next(n for n, s in self._seeds.items() if s == seed)!r}; two streams "
                             "with one seed would draw the same numbers")
        generators = _generators()
        saved = [g.get_state() for g in generators]
        try:
            self._states[name] = [g.manual_seed(seed).get_state() for g in generators]
        finally:
            for generator, state in zip(generators, saved):
                generator.set_state(state)
        self._seeds[name] = seed

    def stream_state(self, name: str) -> List[torch.Tensor]:
        """A copy of stream ``name``'s state (one per default generator)."""
        return [s.clone() for s in self._states[name]]

    def set_stream_state(self, name: str, state: List[torch.Tensor]) -> None:
        """Puts stream ``name`` back where ``stream_state`` found it."""
        self._states[name] = [s.clone() for s in state]

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL) -> Iterator[None]:
        """Draws from stream ``name`` inside the block; the default streams
        are left where they were."""
        if name not in self._states:
            raise KeyError(f"RNGStatesTracker.fork: no stream {name!r}; known: {self.names()} "
                           "(call ts.random.model_parallel_seed(seed) first)")
        generators = _generators()
        saved = [g.get_state() for g in generators]
        for generator, state in zip(generators, self._states[name]):
            generator.set_state(state)
        try:
            yield
        finally:
            self._states[name] = [g.get_state() for g in generators]
            for generator, state in zip(generators, saved):
                generator.set_state(state)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The tracker that ``fork()`` and ``model_parallel_seed()`` use."""
    return _TRACKER


def fork(name: str = MODEL_PARALLEL):
    """Context manager: draw from the tracked stream ``name`` (default: the
    model-parallel stream, different per tensor-parallel rank)."""
    return _TRACKER.fork(name)


def model_parallel_seed(seed: int, group: str = "tp") -> Tuple[int, int]:
    """Seeds both streams on this rank (call it with the same ``seed`` on
    every rank): the default generators (CPU and CUDA) with ``seed``, the
    model-parallel stream with ``seed + 2718 + rank in group``.

    Returns (default seed, model-parallel seed) of this rank.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"model_parallel_seed: seed must be a non-negative int, got {seed!r}")
    from .distributed import state  # the groups are needed only here
    group_rank = state.get_group_rank(group) if state.is_initialized() else 0
    model_parallel = seed + MODEL_PARALLEL_SEED_OFFSET + group_rank
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL, model_parallel)
    return seed, model_parallel


def checkpoint_context_fn(tracker: RNGStatesTracker = None):
    """For ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False,
    context_fn=ts.random.checkpoint_context_fn)``: the recompute starts the
    tracked streams where the forward started them, and leaves them where
    they were before the recompute."""
    tracker = tracker or _TRACKER
    at_forward = tracker.get_states()

    @contextlib.contextmanager
    def recompute():
        current = tracker.get_states()
        tracker.set_states(at_forward)
        try:
            yield
        finally:
            tracker.set_states(current)

    return contextlib.nullcontext(), recompute()


def checkpoint(function, *args, **kwargs):
    """torch.utils.checkpoint.checkpoint, non-reentrant, replaying the tracked
    streams on recompute (see checkpoint_context_fn)."""
    if kwargs.get("use_reentrant", False):
        raise ValueError("ts.random.checkpoint: use_reentrant must be False (the tracked streams are "
                         "replayed through context_fn, which only the non-reentrant checkpoint has), "
                         "got True")
    kwargs["use_reentrant"] = False
    kwargs.setdefault("context_fn", checkpoint_context_fn)
    return torch.utils.checkpoint.checkpoint(function, *args, **kwargs)
