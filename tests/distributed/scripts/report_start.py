"""Prints, as one JSON line, how this rank was started (tests/distributed/test_fork_server.py),
then exits with the code given as its argument, kills itself ("kill") or sleeps ("sleep")."""
import sys

PRELOADED = "torch" in sys.modules  # before any import of this script's: a forked rank has it
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402

print(json.dumps({"preloaded": PRELOADED, "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
                  "name": __name__, "rank": os.environ["RANK"], "extra": os.environ.get("REPORT_START_EXTRA"),
                  "hash": hash("shardtorch"), "random": random.random(), "pid": os.getpid()}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if sys.argv[1] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[1] == "sleep":
    import time
    time.sleep(600)
sys.exit(int(sys.argv[1]))
