"""One rank of a harness launch (see harness.py):
python -m tests.distributed.worker MODULE GROUP_SIZE CASES OUT_DIR INIT"""
import importlib
import json
import os
import sys
import traceback


def main() -> None:
    module_name, group_size, cases, out_dir, init = sys.argv[1:6]
    import torch.distributed as dist

    import shardtorch as ts

    module = importlib.import_module(module_name)
    names = [c for c in cases.split(",") if c] or sorted(n for n in dir(module) if n.startswith("case_"))
    rank = int(os.environ["RANK"])
    if init == "1":
        ts.distributed.init_process_group(group_size=int(group_size))
    results = {}
    for name in names:
        try:
            getattr(module, name)()
            results[name] = None
        except Exception:  # noqa: BLE001 - every failure is reported to pytest
            results[name] = traceback.format_exc()[-4000:]
        if dist.is_initialized():
            dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    if ts.distributed.is_initialized():
        ts.distributed.destroy_process_group()
    elif dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
