"""SHARDTORCH_TIMEOUT is read when a group is made, not when shardtorch is imported: a value set
after the import counts, and a bad one fails there with the variable's name (as the C++ API's
default_timeout does), not the import."""
import datetime

import pytest

from shardtorch.distributed import state


def test_the_variable_is_read_at_each_call(monkeypatch):
    monkeypatch.delenv("SHARDTORCH_TIMEOUT", raising=False)
    assert state.default_timeout() == datetime.timedelta(seconds=300)
    monkeypatch.setenv("SHARDTORCH_TIMEOUT", "42")
    assert state.default_timeout() == datetime.timedelta(seconds=42)
    monkeypatch.setenv("SHARDTORCH_TIMEOUT", "")
    assert state.default_timeout() == datetime.timedelta(seconds=300)


def test_a_bad_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("SHARDTORCH_TIMEOUT", "ten")
    with pytest.raises(ValueError, match="SHARDTORCH_TIMEOUT must be a number of seconds, got 'ten'"):
        state.default_timeout()
