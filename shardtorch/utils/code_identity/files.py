"""Which code counts by name (torch's and Python's own files), which is installed (site-packages), and
an installed file's stamp: conda and the python Docker images keep site-packages under the standard
library's folder, so the two are told apart."""
import os
import site
import sys
import sysconfig
import types
from typing import Dict, Optional

import torch


def _roots():
    """(torch's folder, Python's own library folders, the package folders that may lie inside them: conda
    and the python Docker images keep site-packages under the standard library's folder)."""
    sep = os.sep
    torch_dir = os.path.dirname(torch.__file__) + sep
    paths = sysconfig.get_paths()
    stdlib = tuple({paths[k] + sep for k in ("stdlib", "platstdlib") if paths.get(k)})
    sites = [paths.get("purelib"), paths.get("platlib")]
    try:
        sites += site.getsitepackages() + [site.getusersitepackages()]
    except AttributeError:  # a virtualenv's old site.py
        pass
    return torch_dir, stdlib, tuple({s + sep for s in sites if s})


_TORCH_DIR, _STDLIB, _SITES = _roots()
_named_only_files: Dict[str, bool] = {}


def named_only_file(filename: str) -> bool:
    """Whether a function of this file counts by name (torch's and the standard library's)."""
    answer = _named_only_files.get(filename)
    if answer is None:
        answer = filename.startswith((_TORCH_DIR, "<frozen ")) or (
            filename.startswith(_STDLIB) and not filename.startswith(_SITES)
            and "site-packages" not in filename and "dist-packages" not in filename)
        _named_only_files[filename] = answer
    return answer


def _named_only(function: types.FunctionType) -> bool:
    return named_only_file(function.__code__.co_filename)


_library_classes: Dict[type, bool] = {}


def _library_class(cls: type) -> bool:
    """A class of torch, Python or a C extension: counted by name. A class of a notebook or of a module
    without a file is not one."""
    answer = _library_classes.get(cls)
    if answer is None:
        module = getattr(cls, "__module__", None)
        module = module if isinstance(module, str) else ""
        file = getattr(sys.modules.get(module), "__file__", None)
        answer = (module == "builtins" or module.split(".")[0] == "torch"
                  or (isinstance(file, str) and (named_only_file(file) or not file.endswith(".py"))))
        _library_classes[cls] = answer
    return answer


def installed_file(filename: str) -> bool:
    return (named_only_file(filename) or filename.startswith(_SITES) or "site-packages" in filename
            or "dist-packages" in filename)


def _class_file(cls: type) -> Optional[str]:
    """The file of ``cls``'s module, or None (a notebook's, a module without a file)."""
    file = getattr(sys.modules.get(getattr(cls, "__module__", None) or ""), "__file__", None)
    return file if isinstance(file, str) else None


def _installed_class(cls: type) -> bool:
    """A class of an installed package (transformers, peft): its methods other than forward and __call__
    are followed where code names them, not all of them (a PeftModel's hundreds)."""
    file = _class_file(cls)
    return file is not None and installed_file(file)


_stamps: Dict[str, str] = {}


def _file_stamp(file: str) -> str:
    """An installed file's size and modification time, once per process: a package upgraded or edited in
    place changes it, and with it the constants and helpers its functions reach (not walked)."""
    stamp = _stamps.get(file)
    if stamp is None:
        try:
            stat = os.stat(file)
            stamp = f"{stat.st_size} {stat.st_mtime_ns}"
        except OSError:
            stamp = "?"
        _stamps[file] = stamp
    return stamp
