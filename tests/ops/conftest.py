"""Single-process op tests run in a world of one rank (tests/conftest.py)."""
import pytest


@pytest.fixture(autouse=True)
def _ops_need_a_group(world_of_one):
    yield
