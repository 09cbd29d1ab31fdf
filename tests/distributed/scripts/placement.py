"""One rank under torchrun: initialises shardtorch with each group size given
after the output folder on the command line and writes, per size, whether a
PlacementWarning came and its text to OUT/rank<r>.json (for
tests/distributed/test_placement.py)."""
import json
import os
import sys
import warnings

import shardtorch as ts
from shardtorch.distributed.placement import PlacementWarning


def main() -> None:
    out_dir, reports = sys.argv[1], []
    for group_size in map(int, sys.argv[2:]):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ts.distributed.init_process_group(group_size=group_size)
        messages = [str(w.message) for w in caught if issubclass(w.category, PlacementWarning)]
        reports.append({"rank": ts.distributed.get_rank(), "group_size": group_size, "warnings": messages})
    with open(os.path.join(out_dir, f"rank{ts.distributed.get_rank()}.json"), "w") as f:
        json.dump(reports, f)
    ts.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
