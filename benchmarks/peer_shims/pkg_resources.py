"""Stand-in for setuptools' pkg_resources, which setuptools 81 and later no longer ship, for peers
that still import it (tensor_parallel 2.0.0 reads one package version through it). Only what they
use: get_distribution(name).version, from importlib.metadata."""
from importlib import metadata
from types import SimpleNamespace


def get_distribution(name: str):
    return SimpleNamespace(version=metadata.version(name))
