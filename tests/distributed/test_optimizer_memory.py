"""Peak memory of collect/relocate_optimizer_state_dict against the state size (2 ranks)."""
import glob
import json

from tests.distributed.harness import launch

MODULE = "tests.distributed.cases_optimizer_memory"


def test_peak_memory_of_optimizer_collect_and_relocate(tmp_path):
    # Large blocks straight from mmap, returned to the system when freed (as test_checkpoint_memory).
    results = launch(MODULE, 2, 2, env={"SHARDTORCH_CKPT_DIR": str(tmp_path),
                                        "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)})
    for path in sorted(glob.glob(str(tmp_path / "optimizer-memory-rank*.json"))):
        with open(path) as f:
            m = json.load(f)
        print("rank {rank}: Adam state {full_state_bytes} B in full, shards {state_shard_bytes} B; peak extra: "
              "collect_optimizer_state_dict(dst=0) {collect_to_dst0} B, "
              "relocate_optimizer_state_dict(src=0) {relocate_from_src0} B".format(**m))
    failed = {c: e for c, e in results.items() if e is not None}
    assert not failed, failed
