"""ts.nn.parallelize is the function and its package has a distinct name, so neither hides the other."""
import importlib
import inspect

import shardtorch as ts


def test_public_names_are_the_functions():
    for name in ("parallelize", "auto_plan", "causal_lm_loss"):
        assert inspect.isfunction(getattr(ts.nn, name)), name


def test_package_imports_as_a_module_with_its_pieces():
    package = importlib.import_module("shardtorch.nn.whole_model")
    assert inspect.ismodule(package)
    assert package.parallelize is ts.nn.parallelize
    assert package.causal_lm_loss is ts.nn.causal_lm_loss
    assert package.auto_plan is ts.nn.auto_plan
    assert callable(package.unplaced)
