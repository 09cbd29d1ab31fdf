"""What setup.py needs before it runs CMake: torch importable (the library is
built against the torch it will run with) and a CMake new enough. Only the
standard library: setup.py imports this before anything is installed."""
import importlib.util
import os
import shutil
import subprocess
import sys

MIN_CMAKE = (3, 18)  # the CUDA part needs 3.25.2: cmake/ShardtorchCuda.cmake says so itself
NO_TORCH = ("shardtorch builds against the torch you will run it with, and this build cannot import torch "
            "(pip's build isolation hides it): install torch first, then "
            "`pip install --no-build-isolation .` (or `bash scripts/setup.sh`)")


def require_torch():
    if importlib.util.find_spec("torch") is None:
        sys.exit("error: " + NO_TORCH)


def cmake_version(cmake):
    try:
        out = subprocess.run([cmake, "--version"], stdout=subprocess.PIPE, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    first = out.split()[2] if len(out.split()) > 2 else ""
    return tuple(int(part) for part in first.split("-")[0].split(".")[:3] if part.isdigit())


def find_cmake():
    """SHARDTORCH_CMAKE if set, else the newest of pip's cmake (the `cmake`
    package, when installed) and the one on PATH, as (path, version); exits
    with one line if none is new enough."""
    candidates = []
    if os.environ.get("SHARDTORCH_CMAKE"):
        candidates = [os.environ["SHARDTORCH_CMAKE"]]
    else:
        candidates = _installed_cmakes()
    found = [(path, cmake_version(path)) for path in candidates]
    found = [(path, version) for path, version in found if version]
    if not found:
        sys.exit("error: shardtorch needs CMake >= 3.18: `pip install cmake` (or apt-get install cmake)")
    path, version = max(found, key=lambda item: item[1])
    if version < MIN_CMAKE:
        sys.exit(f"error: shardtorch needs CMake >= 3.18, found {'.'.join(map(str, version))} at {path}: "
                 "`pip install cmake`")
    return path, version


def _installed_cmakes():
    candidates = []
    try:
        import cmake as cmake_package
        candidates.append(os.path.join(cmake_package.CMAKE_BIN_DIR, "cmake"))
    except (ImportError, AttributeError):
        pass
    if shutil.which("cmake"):
        candidates.append(shutil.which("cmake"))
    return candidates
