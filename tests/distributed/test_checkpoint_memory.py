"""Peak memory of collect/relocate against the model size (2 ranks)."""
import glob
import json

from tests.distributed.harness import launch

MODULE = "tests.distributed.cases_checkpoint_memory"


def test_peak_memory_of_collect_and_relocate(tmp_path):
    # Large blocks straight from mmap, returned to the system when freed: then
    # resident memory follows the live tensors instead of glibc's reused heap.
    results = launch(MODULE, 2, 2, env={"SHARDTORCH_CKPT_DIR": str(tmp_path),
                                        "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)})
    for path in sorted(glob.glob(str(tmp_path / "memory-rank*.json"))):
        with open(path) as f:
            m = json.load(f)
        print("rank {rank}: model {full_model_bytes} B in full, shards {shard_bytes} B; peak extra: "
              "collect(dst=0) {collect_to_dst0} B, relocate(src=0) {relocate_from_src0} B, "
              "collect(dst=None) {collect_to_every_rank} B".format(**m))
    failed = {c: e for c, e in results.items() if e is not None}
    assert not failed, failed
