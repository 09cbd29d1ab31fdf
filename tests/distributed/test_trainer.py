"""Hugging Face's Trainer over a parallelized model (shardtorch.utils.trainer.TensorParallelTrainer), at 2 ranks
in one tensor-parallel group and at 4 in 2 x 2 (Gloo, CPU, float64)."""
from tests.distributed.harness import case_tests

test_trainer = case_tests("tests.distributed.cases_trainer", world_size=2)
# 2 data-parallel x 2 tensor-parallel: the groups get different batches, the ranks of a group the same.
test_trainer_data_parallel = case_tests("tests.distributed.cases_trainer", world_size=4, group_size=2,
                                        cases=["case_tensor_parallel_trainer_trains_and_saves_the_unsharded_model"])
