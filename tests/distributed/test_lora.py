"""LoRA with peft on parallelized models, at 2 and 3 ranks (cases_lora.py); skipped without peft."""
import pytest

from tests.distributed.harness import case_tests

pytest.importorskip("peft")

test_lora = case_tests("tests.distributed.cases_lora", world_size=(2, 3))
