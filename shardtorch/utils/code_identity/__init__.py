"""A digest of Python values and of the code they reach: two calls whose digests agree describe the
same values and run the same code. The proof's cache (nn/whole_model/proof_cache.py) keys a proven
split by it, so that an edited model file or script, a patched function or flag, or a changed
registry entry is proven again.

- values.py: values (``Description``). Simple ones by repr; tensors and arrays by shape, dtype and
  device, and contents (up to 65,536 elements; a buffer past that by 65,536 values evenly spaced);
  containers item by item; modules by class, attributes, parameter shapes, ties and hooks; functions,
  methods, partials (with their arguments) handed to the walk; other objects by class and attributes,
  and their class's methods followed; the values a class defines (an installed package's classes by
  their file's stamp); objects of torch's and Python's classes by their simple attributes, containers
  and namespaces (a Namespace's flags, autocast's dtype). A value nested past 12 levels raises
  (``TooDeep``): the caller proves instead of trusting a digest cut short.
- walk.py: code (``reachable_code_digest``). The model's own files and code outside installed packages
  (a script's, a notebook's) by bytecode, constants, defaults and closures, followed through every
  global they load, by value (with the variables of the environment they name in upper case), and
  through every name any class of the method's owner defines
  (``self.FLAG``, ``super().forward``); a decorated method's wrapped function keeps its class. Other
  installed code by its bytecode, its file's stamp and the functions its globals name; torch's and
  Python's by name, except where a name they load now holds other code (a patch: ``F.silu``).
  A walk is reused within a process while every binding it read (names, methods, code, closures,
  mutable values, environment variables) still holds.
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
