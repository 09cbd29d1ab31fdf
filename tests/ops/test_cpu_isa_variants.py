"""The hand-written CPU kernels are compiled three times (baseline x86-64, AVX2,
AVX-512; csrc/ops/cpu/vector_isa.h) and run the widest variant the CPU has, or
a narrower one SHARDTORCH_CPU_ISA asks for. Each variant this machine can run
is checked in its own process against float64 references: the sampled margin
head's gather of normalised rows and its projection of the weight gradient's
rows (rows whose norms span twelve orders of magnitude, a row below eps and a
zero row), float32 and float64, both of the head's paths, at 6 features and at
67 (the vector loops and their tails) with more than 128 kept rows; and the
row-sparse SGD kernel (every setting, 37 and 512 columns) against SGD's formula
in float64 and bit for bit against torch's fused SGD kernel, and the row-sparse
Adam kernel (rows at different steps) against Adam's formula in float64."""
import os
import subprocess
import sys

import pytest

import shardtorch as ts
from tests.launcher import REPO

ORDER = ["baseline", "avx2", "avx512"]
WIDEST = ts._C._cpu_vector_isa()

CHECK = """
import tempfile, torch, torch.distributed as dist, shardtorch as ts
from tests.ops.test_margin_ops import check_weight_rows_of_very_different_norms as check
dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
ts.distributed.init_process_group(group_size=1)
print(ts._C._cpu_vector_isa())
for path in ("in_forward", "by_chunks"):
    for dtype in (torch.float32, torch.float64):
        for large in (False, True):
            check("cpu", path, True, dtype, large)
            check("cpu", path, False, dtype, large)
from tests.ops.test_row_sparse_sgd_op import SETTINGS, device_case
from tests.ops.test_row_sparse_sgd_op import test_the_rows_given_get_the_bits_of_torchs_fused_sgd as same_bits
for name in SETTINGS:
    for dtype in (torch.float32, torch.float64):
        for columns in (37, 512):
            device_case("cpu", dtype, name, columns)
        if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
            same_bits(name, dtype)
from tests.ops.test_row_sparse_adam_op import SETTINGS as ADAM_SETTINGS, device_case as adam_case
for name in ADAM_SETTINGS:
    for dtype in (torch.float32, torch.float64):
        for columns in (37, 512):
            adam_case("cpu", dtype, name, columns)
"""


def _run(code, isa):
    env = dict(os.environ, SHARDTORCH_CPU_ISA=isa, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("isa", ORDER)
def test_each_variant_matches_the_float64_reference(isa):
    if ORDER.index(isa) > ORDER.index(WIDEST):
        pytest.skip(f"this CPU runs {WIDEST} at most")
    done = _run(CHECK, isa)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == [isa], done.stdout


def test_a_wider_variant_than_the_cpu_has_is_not_taken_and_a_bad_name_is_refused():
    done = _run("import shardtorch as ts; print(ts._C._cpu_vector_isa())", "avx512")
    assert done.returncode == 0 and done.stdout.split() == [WIDEST], done.stdout + done.stderr
    done = _run("import shardtorch as ts; print(ts._C._cpu_vector_isa())", "sse9")
    assert done.returncode != 0 and "SHARDTORCH_CPU_ISA must be baseline, avx2 or avx512, got 'sse9'" in done.stderr, \
        done.stderr
