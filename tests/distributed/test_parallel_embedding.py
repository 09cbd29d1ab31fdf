"""ParallelEmbedding and the layer conversions in real multi-process runs (Gloo, CPU)."""
from tests.distributed.harness import case_tests

test_parallel_embedding = case_tests("tests.distributed.cases_embedding", world_size=(2, 4))
