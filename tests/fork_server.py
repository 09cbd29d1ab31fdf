"""The test ranks' fork servers: shardtorch.utils.fork_server's ForkServers, configured for the test
harness (tests/launcher.py starts ranks through ``spawn``). Their environment is a plain rank's
(tests/launcher.py's rank_env, no extra variables) in pytest's environment when the first rank is
spawned; ``SHARDTORCH_TEST_FORK=0`` turns them off. torchrun's agents (the elastic tests) and the
C++ programs always start by exec."""
from shardtorch.utils.fork_server import ForkedRank, ForkServers

# Read when used by the harness, the case modules and scripts, never at import.
TEST_RUNTIME_VARIABLES = (
    "SHARDTORCH_TEST_SCRATCH", "SHARDTORCH_CKPT_DIR", "SHARDTORCH_OPTIM_STATE_DIR", "SHARDTORCH_PRETRAINED_DIR",
    "SHARDTORCH_FSDP_HANDOFF",
    "BAD_SETUP_DONE_DIR", "PEER_FAILURE_DONE_FILE",  # tests/distributed/scripts' own
    "PYTEST_CURRENT_TEST",  # pytest's name of the running test, different in each
)
# (Not the modules the ranks run: runpy warns when its target is imported already.)
PRELOAD = ("torch", "torch.distributed", "shardtorch", "torch._dynamo")
OPTIONAL_PRELOAD = ("transformers",)  # the "hf" extra; absent from the CPU-only smoke's venv


def _session_env():
    from tests.launcher import rank_env
    return rank_env(0, 1, 0)


def _session_cwd():
    from tests.launcher import REPO
    return REPO


SERVERS = ForkServers(PRELOAD, OPTIONAL_PRELOAD, TEST_RUNTIME_VARIABLES, _session_env, _session_cwd,
                      switch="SHARDTORCH_TEST_FORK")
spawn = SERVERS.spawn
_enabled = SERVERS.enabled

__all__ = ["ForkedRank", "SERVERS", "spawn"]
