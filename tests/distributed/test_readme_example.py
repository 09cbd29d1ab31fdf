"""The README's ten-line Python example on 2 real ranks: its loss makes one
collective forward and none backward, counted by the profiler (cases_readme.py)."""
from tests.distributed.harness import case_tests

test_readme_example = case_tests("tests.distributed.cases_readme", world_size=2, init=False)
