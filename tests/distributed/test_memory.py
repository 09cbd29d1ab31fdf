"""Peak memory of collect/relocate against the size of what they move, per
rank, on 2 ranks: the model state (cases_checkpoint_memory.py) and the Adam
state (cases_optimizer_memory.py), in one launch. Run with -s to see the peaks."""
import glob
import json
import os

from tests.distributed.harness import reads_launch, scratch_dir

CHECKPOINT = "tests.distributed.cases_checkpoint_memory"
OPTIMIZER = "tests.distributed.cases_optimizer_memory"
# Large blocks straight from mmap, returned to the system when freed: then
# resident memory follows the live tensors instead of glibc's reused heap.
ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}


def _check(launches, module, pattern, line):
    results = launches.get(module, 2, env=ENV)
    for path in sorted(glob.glob(os.path.join(scratch_dir(), pattern))):
        with open(path) as f:
            print(line.format(**json.load(f)))
    failed = {c: e for c, e in results.items() if e is not None}
    assert not failed, failed


@reads_launch(CHECKPOINT, 2, env=ENV)
@reads_launch(OPTIMIZER, 2, env=ENV)
def test_peak_memory_of_collect_and_relocate(launches):
    _check(launches, CHECKPOINT, "memory-rank*.json",
           "rank {rank}: model {full_model_bytes} B in full, shards {shard_bytes} B; peak extra: "
           "collect(dst=0) {collect_to_dst0} B, relocate(src=0) {relocate_from_src0} B, "
           "collect(dst=None) {collect_to_every_rank} B")


@reads_launch(CHECKPOINT, 2, env=ENV)
@reads_launch(OPTIMIZER, 2, env=ENV)
def test_peak_memory_of_optimizer_collect_and_relocate(launches):
    _check(launches, OPTIMIZER, "optimizer-memory-rank*.json",
           "rank {rank}: Adam state {full_state_bytes} B in full, shards {state_shard_bytes} B; peak extra: "
           "collect_optimizer_state_dict(dst=0) {collect_to_dst0} B, "
           "relocate_optimizer_state_dict(src=0) {relocate_from_src0} B")
