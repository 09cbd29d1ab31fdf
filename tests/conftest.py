import pytest

from tests.distributed.harness import LaunchCache


@pytest.fixture(scope="session")
def launches():
    """Multi-process launches shared by every test of the session."""
    return LaunchCache()
