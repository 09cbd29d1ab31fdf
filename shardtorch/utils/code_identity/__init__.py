"""A digest of Python values and of the code they reach: two calls whose digests agree describe the
same values and run the same code. The proof's cache (nn/whole_model/proof_cache.py) keys a proven
split by it, so that an edited model file or script, a patched function or flag, or a changed
registry entry is proven again.

- values.py: values (``Description``). Simple ones by repr; tensors and arrays by shape, dtype and
  device, small ones (up to 65,536 elements) by their contents too; containers item by item; modules
  by class, attributes, parameter shapes and hooks; functions, methods, partials (with their
  arguments) handed to the walk; other objects by class and attributes, and their class's methods
  followed; objects of torch's and Python's classes by their simple attributes (a Namespace's flags,
  autocast's dtype).
- walk.py: code (``reachable_code_digest``). The model's own files and code outside installed packages
  (a script's, a notebook's) by bytecode, constants, defaults and closures, followed through every
  global they load, by value, and through every name any class of the method's owner defines
  (``self.FLAG``, ``super().forward``); a decorated method's wrapped function keeps its class. Other
  installed code by its bytecode, its file's stamp and the functions its globals name; torch's and
  Python's by name, except where a name they load now holds other code (a patch: ``F.silu``).
  A walk is reused within a process while every binding it read (names, methods, code, closures,
  mutable values) still holds.
- bytecode.py: code objects' digests and the names they use; files.py: which files count by name and
  which are installed.

What it cannot see: code reached only through objects passed in at run time (a callback argument),
a global patched two calls deep inside an installed package, and code that is not Python.
"""
from .bytecode import as_function, class_attribute, code_digest
from .files import installed_file, named_only_file
from .values import Description
from .walk import reachable_code_digest

__all__ = ["Description", "as_function", "class_attribute", "code_digest", "installed_file", "named_only_file",
           "reachable_code_digest"]
