"""One rank of a harness launch (see harness.py):
python -m tests.distributed.worker REQUESTS GROUP_SIZE OUT_DIR INIT

REQUESTS is JSON: [[module, [case, ...]], ...]; an empty case list means every
``case_*`` of the module. The rank writes OUT_DIR/rank<RANK>.json after every
case (and names the case it is about to run), so that when a case kills the
process the harness still knows which cases finished and which one crashed."""
import importlib
import json
import os
import sys
import traceback


def _write(path: str, report: dict) -> None:
    # Replace, never truncate in place: a crash mid-write must leave the last report whole.
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(path + ".tmp", path)


def main() -> None:
    requests, group_size, out_dir, init = sys.argv[1:5]
    import torch.distributed as dist

    import shardtorch as ts

    rank = int(os.environ["RANK"])
    path = os.path.join(out_dir, f"rank{rank}.json")
    # results: {module: {case: None or error}}; running: [module, case] or None.
    report = {"results": {}, "running": None}
    _write(path, report)
    if init == "1":
        ts.distributed.init_process_group(group_size=int(group_size))
    for module_name, cases in json.loads(requests):
        results = report["results"].setdefault(module_name, {})
        try:
            module = importlib.import_module(module_name)
        except Exception:  # noqa: BLE001 - an import error fails each of its cases, not the launch
            error = "importing the case module failed:\n" + traceback.format_exc()[-4000:]
            results.update({name: error for name in cases})
            _write(path, report)
            continue
        for name in cases or sorted(n for n in dir(module) if n.startswith("case_")):
            report["running"] = [module_name, name]
            _write(path, report)
            try:
                getattr(module, name)()
                results[name] = None
            except Exception:  # noqa: BLE001 - every failure is reported to pytest
                results[name] = traceback.format_exc()[-4000:]
            _write(path, report)
            if dist.is_initialized():
                dist.barrier()
            report["running"] = None
            _write(path, report)
    if ts.distributed.is_initialized():
        ts.distributed.destroy_process_group()
    elif dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
