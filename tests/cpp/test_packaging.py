"""The install commands as users type them, run for real (docs/building.md):

- the configure step with Debian's cmake first on PATH (3.25.1 cannot set nvcc's
  C++20 dialect): setup.py picks pip's cmake; Debian's named explicitly
  configures without the CUDA part and refuses it in one line;
- `pip install .` with pip's build isolation (which hides torch) stops in one
  line that says what to type instead;
- `pip wheel --no-build-isolation .` from the existing build tree gives a wheel
  that, unpacked into a fresh folder, imports and runs without
  LD_LIBRARY_PATH, and whose CMake config builds and runs a C++ program.
"""
import glob
import os
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch

import shardtorch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEBIAN_CMAKE = "/usr/bin/cmake"
NO_TORCH_LINE = "this build cannot import torch"
CUDA_CMAKE_LINE = "the CUDA part needs CMake >= 3.25.2"


def _version(cmake):
    out = subprocess.run([cmake, "--version"], stdout=subprocess.PIPE, text=True).stdout
    return tuple(int(p) for p in out.split()[2].split(".")[:3])


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    env.update(extra)
    return env


def _run(cmd, timeout=600, **kwargs):
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                          **kwargs)


def _configure(tmp_path, **env):
    """setup.py's own configure step (SHARDTORCH_CONFIGURE_ONLY) into a fresh build folder."""
    build = tmp_path / "build"
    proc = _run([sys.executable, "setup.py", "-q", "build_ext"], cwd=REPO,
                env=_env(SHARDTORCH_BUILD_DIR=str(build), SHARDTORCH_CONFIGURE_ONLY="1", **env))
    cache = build / "CMakeCache.txt"
    return proc, cache.read_text() if cache.exists() else ""


@pytest.fixture
def old_debian_cmake():
    if not os.path.exists(DEBIAN_CMAKE) or _version(DEBIAN_CMAKE) >= (3, 25, 2):
        pytest.skip(f"needs a CMake older than 3.25.2 at {DEBIAN_CMAKE} (Debian 12's 3.25.1)")
    return DEBIAN_CMAKE


def test_configure_with_debians_cmake_first_on_path_uses_pips(tmp_path, old_debian_cmake):
    path = os.pathsep.join(["/usr/bin", os.environ.get("PATH", "")])
    cuda = "1" if torch.version.cuda else "0"
    proc, cache = _configure(tmp_path, PATH=path, SHARDTORCH_CUDA=cuda)
    assert proc.returncode == 0, proc.stdout[-4000:]
    command = next(line.split("=", 1)[1] for line in cache.splitlines() if line.startswith("CMAKE_COMMAND:"))
    assert command != old_debian_cmake and _version(command) >= (3, 25, 2), command
    assert f"SHARDTORCH_CUDA:STRING={'ON' if cuda == '1' else 'OFF'}" in cache


@pytest.mark.parametrize("asked", [None, "1"])
def test_the_test_doubles_are_built_only_when_asked_for(tmp_path, monkeypatch, asked):
    """shardtorch._C_testing (the C++ core's test doubles) is a module of its own, built only with
    SHARDTORCH_BUILD_TEST_DOUBLES=1 (scripts/test.sh sets it): a user's build has no target for it."""
    monkeypatch.delenv("SHARDTORCH_BUILD_TEST_DOUBLES", raising=False)
    proc, cache = _configure(tmp_path, SHARDTORCH_CUDA="0", **({"SHARDTORCH_BUILD_TEST_DOUBLES": asked} if asked else {}))
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert f"SHARDTORCH_BUILD_TEST_DOUBLES:BOOL={'ON' if asked else 'OFF'}" in cache
    ninja = (tmp_path / "build" / "build.ninja").read_text()
    assert ("_C_testing" in ninja) == bool(asked)


def test_debians_cmake_builds_without_cuda_and_refuses_it_in_one_line(tmp_path, old_debian_cmake):
    proc, _ = _configure(tmp_path / "cpu", SHARDTORCH_CMAKE=old_debian_cmake, SHARDTORCH_CUDA="0")
    assert proc.returncode == 0, proc.stdout[-4000:]
    if not torch.version.cuda or not os.path.exists("/usr/local/cuda/bin/nvcc"):
        pytest.skip("the CUDA half needs a CUDA torch and nvcc")
    proc, _ = _configure(tmp_path / "cuda", SHARDTORCH_CMAKE=old_debian_cmake, SHARDTORCH_CUDA="1")
    assert proc.returncode != 0
    lines = [line for line in proc.stdout.splitlines() if CUDA_CMAKE_LINE in line]
    assert lines and "pip install cmake" in proc.stdout, proc.stdout[-4000:]
    assert "CUDA20" not in proc.stdout, proc.stdout[-4000:]  # our line, before CMake's own dialect error


def test_isolated_pip_install_stops_in_one_line(tmp_path):
    # pip builds in an isolated environment with only pyproject's build requirements: no torch.
    proc = _run([sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check",
                 "--target", str(tmp_path / "target"), "."], cwd=REPO, env=_env(), timeout=600)
    assert proc.returncode != 0, proc.stdout[-4000:]
    lines = [line for line in proc.stdout.splitlines() if NO_TORCH_LINE in line]
    assert len(lines) == 1 and "pip install --no-build-isolation ." in lines[0], proc.stdout[-4000:]
    assert "-- Configuring" not in proc.stdout, proc.stdout[-4000:]  # stopped before CMake
    assert not (tmp_path / "target").exists() or not os.listdir(tmp_path / "target")


def _existing_build_dir():
    torch_ver = torch.__version__.split("+")[0]
    build = os.path.join(REPO, "build", f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch_ver}")
    if not os.path.exists(os.path.join(build, "CMakeCache.txt")):
        pytest.skip(f"no build tree at {build}: the package was not built in place by scripts/setup.sh")
    return build


def _cuda_flag_of(build):
    with open(os.path.join(build, "CMakeCache.txt")) as f:
        cache = f.read()
    return "1" if "SHARDTORCH_CUDA:STRING=ON" in cache else "0" if "SHARDTORCH_CUDA:STRING=OFF" in cache else "auto"


def test_wheel_from_the_build_tree_works_unpacked_anywhere(tmp_path):
    build = _existing_build_dir()
    wheels = tmp_path / "wheels"
    # The same configuration as the editable build, so that nothing recompiles.
    env = _env(SHARDTORCH_BUILD_DIR=build, SHARDTORCH_CUDA=_cuda_flag_of(build))
    try:
        proc = _run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                     "--disable-pip-version-check", "-w", str(wheels), "."], cwd=REPO, env=env, timeout=900)
    finally:
        # Give the build tree its editable install prefix back (the wheel's was a temporary folder).
        _run(["cmake", "-DCMAKE_INSTALL_PREFIX=" + os.path.join(REPO, "shardtorch"), build], env=_env())
    assert proc.returncode == 0, proc.stdout[-4000:]
    (wheel,) = glob.glob(str(wheels / "shardtorch-*.whl"))
    fresh = tmp_path / "unpacked"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(fresh)
    for mode in glob.glob(str(fresh / "shardtorch" / "**" / "*.so*"), recursive=True):
        os.chmod(mode, 0o755)  # zipfile drops permissions; pip would keep them
    names = set(os.path.relpath(p, fresh) for p in glob.glob(str(fresh / "shardtorch" / "**"), recursive=True))
    assert any(n.startswith(os.path.join("shardtorch", "lib", "libshardtorch.so")) for n in names), sorted(names)
    assert os.path.join("shardtorch", "lib", "cmake", "shardtorch", "shardtorchConfig.cmake") in names
    assert os.path.join("shardtorch", "include", "shardtorch", "shardtorch.h") in names

    # Python, from the unpacked folder only (torch from this environment), no LD_LIBRARY_PATH.
    program = (
        "import os, tempfile, torch, torch.distributed as dist, shardtorch as ts\n"
        "assert ts.__file__.startswith(os.environ['FRESH']), ts.__file__\n"
        "fd, path = tempfile.mkstemp(); os.close(fd); os.unlink(path)\n"
        "dist.init_process_group('gloo', store=dist.FileStore(path, 1), rank=0, world_size=1)\n"
        "ts.distributed.init_process_group(group_size=1)\n"
        "x, w = torch.randn(3, 5, dtype=torch.float64), torch.randn(7, 5, dtype=torch.float64)\n"
        "y = torch.ops.shard.parallel_linear(x, w, None, 1, 'tp')\n"
        "assert torch.allclose(y, x @ w.T), (y, x @ w.T)\n"
        "print('unpacked wheel ok', ts.cmake_prefix_path)\n")
    proc = _run([sys.executable, "-c", program], cwd=str(tmp_path),
                env=_env(PYTHONPATH=str(fresh), FRESH=str(fresh)), timeout=300)
    assert proc.returncode == 0 and "unpacked wheel ok" in proc.stdout, proc.stdout[-4000:]

    # C++: a program configured with find_package(shardtorch) from the unpacked CMake config.
    project = tmp_path / "cpp"
    project.mkdir()
    shutil.copy(os.path.join(REPO, "tests", "cpp", "test_ops_registered.cpp"), project / "main.cpp")
    (project / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.18)\nproject(consumer LANGUAGES CXX)\nset(CMAKE_CXX_STANDARD 20)\n"
        "set(CMAKE_CXX_FLAGS_RELEASE -O0)\nfind_package(shardtorch 0.1 REQUIRED)\n"
        "add_executable(consumer main.cpp)\ntarget_link_libraries(consumer PRIVATE shardtorch::shardtorch)\n")
    prefix = str(fresh / "shardtorch") + ";" + torch.utils.cmake_prefix_path
    out = project / "build"
    for cmd in (["cmake", "-S", str(project), "-B", str(out), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                 f"-DCMAKE_PREFIX_PATH={prefix}"], ["cmake", "--build", str(out)]):
        proc = _run(cmd, env=_env(), timeout=600)
        assert proc.returncode == 0, proc.stdout[-4000:]
    with open(out / "CMakeCache.txt") as f:
        found = next(line for line in f.read().splitlines() if line.startswith("shardtorch_DIR:PATH="))
    assert found.split("=", 1)[1].startswith(str(fresh)), found
    proc = _run([str(out / "consumer")], env=_env(), timeout=120)
    assert proc.returncode == 0 and "0 missing" in proc.stdout, proc.stdout[-4000:]
