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
import time
import traceback

_STARTED = time.monotonic()  # before torch's imports: a launch's start-up is counted from here


def _write(path: str, report: dict) -> None:
    # Replace, never truncate in place: a crash mid-write must leave the last report whole.
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(path + ".tmp", path)


def _exited(out_dir: str, rank: int) -> bool:
    """Whether rank ``rank`` has exited: the pid in its report names a process
    that is gone or a zombie (its peers then stop waiting for it at once). A
    rank that has not written its report yet has not exited."""
    try:
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            pid = int(json.load(f)["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if not os.path.isdir("/proc"):
        return False  # no way to tell here (Linux only): wait for the deadline
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        return False


def _wait_for_every_rank(out_dir: str, step: int, rank: int, world_size: int, timeout: float) -> None:
    """A barrier through files in OUT_DIR, whether or not a process group is up.
    Cases launched with init=False bring torch.distributed up and down
    themselves: with a barrier only while it was up, a rank could start the
    next case's rendezvous while its peer still served the last case's store,
    join that old store and leave both ranks waiting for each other (seen in
    CI)."""
    open(os.path.join(out_dir, f"done{step}.rank{rank}"), "w").close()
    deadline = time.monotonic() + timeout
    for peer in range(world_size):
        pause = 0.001  # short first (most waits are), then at most 20 ms: the peer may need the core
        while not os.path.exists(os.path.join(out_dir, f"done{step}.rank{peer}")):
            if _exited(out_dir, peer):
                raise RuntimeError(f"rank {rank}: rank {peer} exited before it finished case {step}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {rank}: rank {peer} did not finish case {step} within {timeout:.0f} s")
            time.sleep(pause)
            pause = min(0.02, pause * 2)


def main() -> None:
    requests, group_size, out_dir, init = sys.argv[1:5]
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    path = os.path.join(out_dir, f"rank{rank}.json")
    # results: {module: {case: None or error}}; running: [module, case] or None.
    # First, with the pid, so that a rank dying in its imports is seen as gone by its peers.
    # seconds: {module: {case: seconds}} and ready_after (start to the first case), for
    # pytest's --case-durations (harness.case_durations_report).
    report = {"results": {}, "running": None, "pid": os.getpid(), "seconds": {}, "ready_after": None}
    _write(path, report)
    import torch.distributed as dist

    import shardtorch as ts

    # Longer than a stuck collective's timeout: a peer blocked in one gets there after it.
    wait = 3 * float(os.environ.get("SHARDTORCH_TIMEOUT", "60")) + 60
    step = 0

    def after_case() -> None:
        # Every rank counts the same steps, a case it could not run included.
        nonlocal step
        _wait_for_every_rank(out_dir, step, rank, world_size, wait)
        step += 1
        if dist.is_initialized():  # and a group left broken by the case fails the launch here
            dist.barrier()

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
            for _ in cases:
                after_case()
            continue
        seconds = report["seconds"].setdefault(module_name, {})
        for name in cases or sorted(n for n in dir(module) if n.startswith("case_")):
            report["running"] = [module_name, name]
            _write(path, report)
            started = time.monotonic()
            if report["ready_after"] is None:
                report["ready_after"] = started - _STARTED
            try:
                getattr(module, name)()
                results[name] = None
            except Exception:  # noqa: BLE001 - every failure is reported to pytest
                results[name] = traceback.format_exc()[-4000:]
            seconds[name] = time.monotonic() - started
            _write(path, report)
            after_case()
            report["running"] = None
            _write(path, report)
    if ts.distributed.is_initialized():
        ts.distributed.destroy_process_group()
    elif dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
