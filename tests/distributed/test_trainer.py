"""Hugging Face's Trainer over a parallelized model (shardtorch.utils.trainer.TensorParallelTrainer), at 2 ranks
in one tensor-parallel group (Gloo, CPU, float64)."""
from tests.distributed.harness import case_tests

test_trainer = case_tests("tests.distributed.cases_trainer", world_size=2)
