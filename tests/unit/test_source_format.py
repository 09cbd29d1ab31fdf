"""The C++/CUDA sources follow .clang-format (scripts/setup.sh installs
clang-format from PyPI into the virtual environment)."""
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _clang_format() -> str:
    beside_python = os.path.join(os.path.dirname(sys.executable), "clang-format")
    found = beside_python if os.path.exists(beside_python) else shutil.which("clang-format")
    assert found, "clang-format is missing: scripts/setup.sh installs it (pip install clang-format)"
    return found


def test_cpp_sources_are_formatted():
    files = subprocess.run(["git", "ls-files", "*.h", "*.cpp", "*.cu"], cwd=REPO, check=True,
                           stdout=subprocess.PIPE, text=True).stdout.split()
    assert any(f.startswith("csrc/ops/") for f in files), files
    result = subprocess.run([_clang_format(), "--dry-run", "-Werror", *files], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert result.returncode == 0, (
        "not formatted as .clang-format says (fix: clang-format -i <file>):\n" + result.stdout[-4000:])
