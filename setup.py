"""Builds shardtorch by driving CMake (see CMakeLists.txt).

Environment variables (all optional):
  SHARDTORCH_BUILD_TYPE   Release (default) | Debug | RelWithDebInfo
  SHARDTORCH_CUDA         auto (default: when torch has CUDA, nvcc is found and a GPU is
                          visible) | 1 (build it without a GPU, as CI does) | 0
  SHARDTORCH_CUDA_ARCH    CUDA architectures, TORCH_CUDA_ARCH_LIST syntax (default "9.0")
  SHARDTORCH_JOBS         parallel build jobs (default: number of CPUs)
  SHARDTORCH_BUILD_DIR    CMake build tree (default build/<python>-<torch>)
  SHARDTORCH_BUILD_TESTS  1 to also build the C++ tests (tests/cpp)
  SHARDTORCH_BUILD_TEST_DOUBLES  1 to also build shardtorch._C_testing, the test doubles the
                          Python tests drive (scripts/test.sh sets it; a user's build has none)
  SHARDTORCH_CMAKE        the cmake to run (default: the newest of pip's and PATH's)
  SHARDTORCH_CONFIGURE_ONLY  1: stop after CMake's configure step (checks the toolchain)

Torch must be importable at build time, and the library is built against that
torch: install with `pip install --no-build-isolation .` (or `-e .`). A build
with pip's default isolation cannot see it and stops with one line saying so.

CMake: 3.18 or newer, 3.25.2 or newer with the CUDA part (older ones cannot set
nvcc's C++20 dialect). The `cmake` Python package (pip's, 4.x) is used when it
is installed and newer than the cmake on PATH (tools/setup_helpers/cmake.py).
"""
import os
import shutil
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)
from tools.setup_helpers.cmake import find_cmake, require_torch  # noqa: E402


def _flag(name, default):
    value = os.environ.get(name, default).strip().lower()
    return {"1": "ON", "on": "ON", "true": "ON", "yes": "ON", "0": "OFF", "off": "OFF",
            "false": "OFF", "no": "OFF", "auto": "AUTO"}.get(value, value.upper())


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def run(self):
        # setuptools clears self.inplace while it builds (it copies the module into the source tree
        # afterwards, but not lib/): remember it, so that an in-place build installs in place.
        self.in_source = bool(self.inplace) or bool(getattr(self, "editable_mode", False))
        super().run()

    def build_extension(self, ext):
        require_torch()
        import pybind11
        import torch

        cmake, _ = find_cmake()

        # The package directory that receives _C, lib/, include/ and the CMake
        # config (in place for editable installs and build_ext --inplace).
        if getattr(self, "in_source", False) or self.inplace or getattr(self, "editable_mode", False):
            package_dir = os.path.join(ROOT, "shardtorch")
        else:
            package_dir = os.path.dirname(os.path.abspath(self.get_ext_fullpath(ext.name)))
        torch_ver = torch.__version__.split("+")[0]
        py_ver = f"py{sys.version_info.major}{sys.version_info.minor}"
        build_dir = os.environ.get("SHARDTORCH_BUILD_DIR") or os.path.join(
            ROOT, "build", f"{py_ver}-torch{torch_ver}")
        os.makedirs(build_dir, exist_ok=True)
        site_packages = os.path.dirname(os.path.dirname(torch.__file__))
        args = [
            cmake, "-S", ROOT, "-B", build_dir, "-G", "Ninja",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('SHARDTORCH_BUILD_TYPE', 'Release')}",
            f"-DCMAKE_INSTALL_PREFIX={package_dir}",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path};{pybind11.get_cmake_dir()}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DSHARDTORCH_CUDA={_flag('SHARDTORCH_CUDA', 'auto')}",
            f"-DSHARDTORCH_CUDA_ARCH={os.environ.get('SHARDTORCH_CUDA_ARCH', '9.0')}",
            f"-DSHARDTORCH_TORCH_HAS_CUDA={'ON' if torch.version.cuda else 'OFF'}",
            f"-DSHARDTORCH_GPU_VISIBLE={'ON' if torch.cuda.is_available() else 'OFF'}",
            f"-DSHARDTORCH_NVIDIA_ROOT={os.path.join(site_packages, 'nvidia')}",
            f"-DSHARDTORCH_BUILD_TESTS={_flag('SHARDTORCH_BUILD_TESTS', '0')}",
            f"-DSHARDTORCH_BUILD_TEST_DOUBLES={_flag('SHARDTORCH_BUILD_TEST_DOUBLES', '0')}",
        ]
        subprocess.check_call(args)
        if os.environ.get("SHARDTORCH_CONFIGURE_ONLY") == "1":
            sys.exit(0)
        jobs = os.environ.get("SHARDTORCH_JOBS") or str(os.cpu_count() or 1)
        subprocess.check_call([cmake, "--build", build_dir, "--parallel", jobs])
        subprocess.check_call([cmake, "--install", build_dir])
        # setuptools expects the module where get_ext_fullpath says (it copies it
        # into the source tree itself for editable installs).
        expected = os.path.abspath(self.get_ext_fullpath(ext.name))
        built = os.path.join(package_dir, os.path.basename(expected))
        if os.path.abspath(built) != expected:
            os.makedirs(os.path.dirname(expected), exist_ok=True)
            shutil.copy2(built, expected)


# Optional extras, the one list of what each needs (scripts install through them):
#   test: the test suite's tools; hf: Hugging Face transformers and timm models for
#   ts.nn.parallelize's tests and examples/python/train_lm.py, and peft for LoRA on them
#   (docs/fine-tuning.md; lora_layers.py builds on peft's LoRA layer); bench: what the
#   benchmarks import beside the peer libraries of scripts/setup_peers.sh.
EXTRAS = {
    "test": ["pytest", "hypothesis", "numpy", "tqdm", "clang-format"],
    "hf": ["transformers>=4.56", "timm>=1.0", "tokenizers", "accelerate", "safetensors",
           "peft>=0.21.2"],
    "bench": ["matplotlib", "numpy"],
}

if not {"sdist", "--help", "--version", "clean"} & set(sys.argv[1:]):
    require_torch()  # before pip installs anything more for a build that cannot work

setup(
    name="shardtorch",
    version="0.1.0",
    description="Tensor-parallel layers and losses for PyTorch with a C++/CUDA core",
    packages=find_packages(include=["shardtorch", "shardtorch.*"]),
    ext_modules=[CMakeExtension("shardtorch._C")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.10",
    install_requires=["torch>=2.11", "cloudpickle>=3"],
    extras_require=EXTRAS,
    zip_safe=False,
)
