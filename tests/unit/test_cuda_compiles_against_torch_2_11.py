"""The CUDA sources, and the sources that use torch's distributed API (c10d), compile against
torch 2.11.0's headers (the torch of the GPU machine, where the extension must be built in place),
on a machine without a GPU.

torch 2.11.0+cu130's wheel is downloaded once into ~/.cache/shardtorch/wheels and only its
headers are unpacked (never installed); NCCL and cuBLAS headers come from the nvidia-* wheels
of this environment's torch, CUDA's from the nvcc toolkit. Each CUDA .cpp is parsed with
g++ at -O0, each .cu is compiled by nvcc to PTX for compute_90 (the H200's), all in parallel.
PTX only: nvcc's front ends (cudafe++, cicc) and the host compiler see every line against torch 2.11's
headers; ptxas, which only lowers the PTX to SASS and cannot disagree with the headers, is skipped,
and the host code is compiled at -O0 (nothing here runs it).
Through ccache when it is installed (as the build is), with paths relative to the checkout: a
source whose text, headers and flags all match an earlier successful compile, in this clone or
another (CI's fresh one), is not compiled again (about 80 s of nvcc and 70 s of g++ on 2 cores);
ccache stores no failed compile, so a source that breaks is always compiled and reported.

Also runnable by hand: `python tests/unit/test_cuda_compiles_against_torch_2_11.py`.
"""
import concurrent.futures
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCH_VERSION = "2.11.0"
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "shardtorch")
WHEEL_DIR = os.path.join(CACHE, "wheels")
HEADERS_DIR = os.path.join(CACHE, f"torch-{TORCH_VERSION}-include")
# What CMake would generate (build_info.h): a fixed place, so that ccache's key stays the same.
GENERATED_DIR = os.path.join(CACHE, f"torch-{TORCH_VERSION}-check", "include")
# The CUDA part's sources (CMakeLists.txt's SHARDTORCH_CUDA_SOURCES); the test below checks the list.
CUDA_CPP_SOURCES = ["csrc/comm/nccl_communicator.cpp", "csrc/ops/cuda/cublaslt_gemm.cpp",
                    "csrc/ops/cuda/parallel_linear_cuda.cpp"]
# The unity groups (CMakeLists.txt) holding the users of torch's distributed API (c10d), which changes
# between torch versions more than ATen's: each is compiled as the build compiles it, one unit.
C10D_GROUPS = ["SHARDTORCH_COMM_SOURCES", "SHARDTORCH_API_SOURCES"]
# The definitions torch's CMake config and CMakeLists.txt give every source of the CUDA build.
DEFINES = ["-DSHARDTORCH_WITH_CUDA=1", "-DUSE_C10D_NCCL", "-DUSE_DISTRIBUTED", "-DUSE_C10D_GLOO"]


def cuda_root():
    """The CUDA toolkit (CUDA_HOME, else /usr/local/cuda: /usr/local/bin/nvcc may be a wrapper)."""
    root = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    return root if os.path.exists(os.path.join(root, "bin", "nvcc")) else None


def nvcc_path():
    return os.path.join(cuda_root(), "bin", "nvcc") if cuda_root() else None


def torch_2_11_headers():
    """torch 2.11.0's include folder, downloaded and unpacked on first use."""
    marker = os.path.join(HEADERS_DIR, ".complete")
    if os.path.exists(marker):
        return os.path.join(HEADERS_DIR, "torch", "include")
    wheels = glob.glob(os.path.join(WHEEL_DIR, f"torch-{TORCH_VERSION}-*.whl"))
    if not wheels:
        # The cp312 manylinux wheel is the GPU machine's; its headers are Python-independent.
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                        "--only-binary=:all:", "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64",
                        "-d", WHEEL_DIR, f"torch=={TORCH_VERSION}"], check=True)
        wheels = glob.glob(os.path.join(WHEEL_DIR, f"torch-{TORCH_VERSION}-*.whl"))
    shutil.rmtree(HEADERS_DIR, ignore_errors=True)
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extractall(HEADERS_DIR, [n for n in wheel.namelist() if n.startswith("torch/include/")])
    open(marker, "w").close()
    return os.path.join(HEADERS_DIR, "torch", "include")


BUILD_INFO = ("#pragma once\nnamespace shardtorch {\nconstexpr bool kBuiltWithCuda = true;\n"
              "constexpr bool kBuiltWithGloo = false;\nconstexpr const char* kVersion = \"0.0.0\";\n}\n")


def generated_include():
    """The folder CMake makes include/ of the build tree: shardtorch/build_info.h (written when it
    differs) and the public headers' folders, links to csrc/ (<shardtorch/nn/init.h>)."""
    path = os.path.join(GENERATED_DIR, "shardtorch", "build_info.h")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if not os.path.exists(path) or open(path).read() != BUILD_INFO:
        with open(path, "w") as f:
            f.write(BUILD_INFO)
    for name, target in [(folder, os.path.join("csrc", folder)) for folder in ("distributed", "nn", "ops", "topology")] + [
            ("shardtorch.h", os.path.join("csrc", "shardtorch", "shardtorch.h"))]:
        link, target = os.path.join(GENERATED_DIR, "shardtorch", name), os.path.join(REPO, target)
        if os.path.islink(link) and os.readlink(link) != target:
            os.remove(link)
        if not os.path.islink(link):
            os.symlink(target, link)
    return GENERATED_DIR


def unity_sources():
    """{group: path of a unit including its sources}, written at a fixed place (ccache's key)."""
    cmake = open(os.path.join(REPO, "CMakeLists.txt")).read()
    units = {}
    for group in C10D_GROUPS:
        path = os.path.join(os.path.dirname(GENERATED_DIR), f"unity_{group.lower()}.cpp")
        text = "".join(f'#include "{os.path.join(REPO, src)}"\n' for src in _cmake_list(cmake, group))
        if not os.path.exists(path) or open(path).read() != text:
            with open(path, "w") as f:
                f.write(text)
        units[group] = path
    return units


def compile_commands(torch_include, work_dir, nvcc):
    nvidia = os.path.join(sysconfig.get_paths()["purelib"], "nvidia")
    generated = generated_include()
    cuda_include = os.path.join(cuda_root(), "include")
    flags = DEFINES + ["-I" + generated, "-I" + os.path.join(REPO, "csrc"),
                       "-I" + os.path.join(nvidia, "nccl", "include"), "-I" + os.path.join(nvidia, "cu13", "include"),
                       "-isystem", torch_include, "-isystem", os.path.join(torch_include, "torch/csrc/api/include"),
                       "-isystem", cuda_include]
    commands = {}
    # The .cu files first: nvcc takes longest, so it starts at once while the g++ checks share the other cores.
    for cu in sorted(glob.glob(os.path.join(REPO, "csrc/ops/cuda/*.cu"))):
        out = os.path.join(work_dir, os.path.basename(cu) + ".o")
        commands[os.path.relpath(cu, REPO)] = [nvcc, "-std=c++20", "-gencode", "arch=compute_90,code=compute_90",
                                               "--expt-relaxed-constexpr", "--expt-extended-lambda", "-O0",
                                               "-c", cu, "-o", out] + flags
    # -c (not -fsyntax-only, which ccache cannot cache) at -O0: every template is instantiated, little is optimized.
    commands.update({src: ["g++", "-std=gnu++20", "-O0", "-Wall", "-Wno-unused-parameter"] + flags
                + ["-c", os.path.join(REPO, src), "-o", os.path.join(work_dir, os.path.basename(src) + ".o")]
                for src in CUDA_CPP_SOURCES})
    commands.update({group: ["g++", "-std=gnu++20", "-O0", "-Wall", "-Wno-unused-parameter"] + flags
                     + ["-c", unit, "-o", os.path.join(work_dir, group + ".o")]
                     for group, unit in unity_sources().items()})
    launcher = [shutil.which("ccache")] if shutil.which("ccache") else []
    return {src: launcher + command for src, command in commands.items()}


def compile_all(torch_include):
    """{source: (returncode, output, seconds)} for every CUDA source and c10d group."""
    nvcc = nvcc_path()
    with tempfile.TemporaryDirectory(prefix="shardtorch-torch211-") as work_dir:
        commands = compile_commands(torch_include, work_dir, nvcc)

        # ccache: paths under the checkout are hashed relative to it (as scripts/setup.sh builds).
        env = dict(os.environ, CCACHE_BASEDIR=REPO)

        def run(item):
            start = time.monotonic()
            done = subprocess.run(item[1], capture_output=True, text=True, cwd=REPO, env=env)
            return item[0], (done.returncode, done.stdout + done.stderr, time.monotonic() - start)

        # SHARDTORCH_JOBS as for the build: scripts/test.sh runs this beside the suite on one core.
        jobs = int(os.environ.get("SHARDTORCH_JOBS") or os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            return dict(pool.map(run, commands.items()))


def _cmake_list(cmake: str, name: str) -> list:
    """The files of ``set(NAME ...)`` in CMakeLists.txt, with ${OTHER} lists expanded."""
    items = re.search(r"set\(%s\s(.*?)\)" % re.escape(name), cmake, re.S).group(1).split()
    files = []
    for item in items:
        nested = re.fullmatch(r"\$\{(\w+)\}", item)
        files.extend(_cmake_list(cmake, nested.group(1)) if nested else [item])
    return files


def test_the_checked_sources_are_the_cuda_part():
    cmake = open(os.path.join(REPO, "CMakeLists.txt")).read()
    listed = _cmake_list(cmake, "SHARDTORCH_CUDA_SOURCES")
    assert listed, "CMakeLists.txt lists no CUDA sources"
    assert sorted(s for s in listed if s.endswith(".cpp")) == sorted(CUDA_CPP_SOURCES)
    assert sorted(s for s in listed if s.endswith(".cu")) == sorted(
        os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "csrc/ops/cuda/*.cu")))


@pytest.mark.skipif(nvcc_path() is None, reason="needs nvcc (CUDA toolkit)")
def test_cuda_sources_compile_against_torch_2_11():
    torch_include = torch_2_11_headers()
    # torch 2.11 defines its version in the header-only part (torch/version.h includes it).
    version = open(os.path.join(torch_include, "torch", "headeronly", "version.h")).read()
    assert "TORCH_VERSION_MINOR 11" in version, "the unpacked headers are not torch 2.11's"
    results = compile_all(torch_include)
    failed = {src: out[-4000:] for src, (rc, out, _) in results.items() if rc != 0}
    assert not failed, "\n".join(f"== {src}\n{out}" for src, out in failed.items())


if __name__ == "__main__":
    start = time.monotonic()
    include = torch_2_11_headers()
    print(f"headers ready in {time.monotonic() - start:.1f} s")
    for source, (rc, output, seconds) in compile_all(include).items():
        print(f"{source}: {'ok' if rc == 0 else 'FAILED'} in {seconds:.1f} s")
        if rc:
            print(output[-4000:])
    print(f"total {time.monotonic() - start:.1f} s")
