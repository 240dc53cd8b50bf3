"""`deepspeed` as another name for `meshspeed`, inside one process.

    install()                 # import deepspeed / from deepspeed.x.y import z -> meshspeed
    write_shim(directory)     # a `deepspeed` package that calls install() when imported

Note [the deepspeed alias]
`meshspeed run --deepspeed-compat` puts a generated directory first on PYTHONPATH of the
processes it starts. The directory holds one package, `deepspeed`, whose __init__ calls
`install()`; so `import deepspeed` in the script finds it before any real DeepSpeed in
site-packages, and child processes the script starts (data-loader workers, subprocesses)
inherit the same environment. Without the flag nothing is added: a real DeepSpeed
installed alongside is used as usual.

`install()` does three things:
1. `sys.modules["deepspeed"]` becomes the `meshspeed` module itself (the import
   statement that ran the shim returns whatever sys.modules holds at the end).
2. A finder first on `sys.meta_path` answers every `deepspeed.<path>` with the module
   `meshspeed.<path>`, the same object: `sys.modules["deepspeed.accelerator"] is
   sys.modules["meshspeed.accelerator"]`, so isinstance checks and module-level state
   agree whichever name a line used. Its loader returns the existing module and then
   puts back the module's own `__spec__`, which the import system overwrites with the
   alias's. A path meshspeed lacks is a `ModuleNotFoundError` saying so, naming the
   deepspeed module (not the meshspeed path it was looked up under).
3. `builtins.__import__` is wrapped so that `from deepspeed.x import name` of a name the
   module lacks says that meshspeed does not provide `deepspeed.x.name`, where Python's
   own message would name `meshspeed.x`. Only absolute imports of `deepspeed...` with a
   from-list are looked at; every other import goes straight through. The statement that
   first imports the shim still runs under the original __import__, so each launched rank
   calls install() before the script starts (compat/child.py); a subprocess the script
   starts gets the alias from the shim, with Python's wording for that first statement.
"""

from __future__ import annotations

import builtins
import importlib
import importlib.abc
import importlib.util
import os
import sys
from types import ModuleType

__all__ = ["ALIAS", "TARGET", "install", "is_installed", "uninstall", "write_shim"]

ALIAS = "deepspeed"
TARGET = "meshspeed"

_HINT = ("meshspeed stands in for DeepSpeed here (meshspeed run --deepspeed-compat); "
         "this part of DeepSpeed's API is not provided")


def _real_name(alias_name: str) -> str:
    return TARGET + alias_name[len(ALIAS):]


def _is_alias(name: str) -> bool:
    return name == ALIAS or name.startswith(ALIAS + ".")


def _not_provided(alias_name: str, missing: str) -> ModuleNotFoundError:
    return ModuleNotFoundError(f"No module named {alias_name!r}: {_HINT} (meshspeed has no "
                               f"module {missing})", name=alias_name)


class _Loader(importlib.abc.Loader):
    """Hands the import system an already-imported meshspeed module."""

    def __init__(self, real_name: str):
        self.real_name = real_name
        self._spec = None

    def create_module(self, spec) -> ModuleType:
        module = importlib.import_module(self.real_name)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._spec  # the import system set it to the alias's spec


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if not _is_alias(fullname):
            return None
        real = _real_name(fullname)
        try:
            spec = importlib.util.find_spec(real)
        except ModuleNotFoundError as err:  # a parent is missing, or is a module, not a package
            if err.name and (real == err.name or real.startswith(err.name + ".")):
                raise _not_provided(fullname, err.name) from None
            raise
        if spec is None:
            raise _not_provided(fullname, real)
        return importlib.util.spec_from_loader(fullname, _Loader(real),
                                               is_package=spec.submodule_search_locations is not None)


_finder = _Finder()
_original_import = None


def _import(name, globals=None, locals=None, fromlist=(), level=0):
    module = _original_import(name, globals, locals, fromlist, level)
    if level == 0 and fromlist and _is_alias(name):
        for attr in fromlist:
            if attr != "*" and not hasattr(module, attr):
                raise ImportError(f"cannot import name {attr!r} from {name!r}: {_HINT} "
                                  f"(meshspeed's {module.__name__} has no {attr!r})",
                                  name=name, path=getattr(module, "__file__", None))
    return module


def install() -> ModuleType:
    """Make `deepspeed` and every `deepspeed.*` resolve to meshspeed in this process;
    returns the meshspeed module. Idempotent."""
    global _original_import
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    if _original_import is None:
        _original_import = builtins.__import__
        builtins.__import__ = _import
    meshspeed = importlib.import_module(TARGET)
    sys.modules[ALIAS] = meshspeed
    return meshspeed


def is_installed() -> bool:
    return _finder in sys.meta_path


def uninstall() -> None:
    """Undo `install` (for tests): the finder, the import wrapper and every deepspeed entry."""
    global _original_import
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    if _original_import is not None:
        builtins.__import__ = _original_import
        _original_import = None
    for name in [n for n in sys.modules if _is_alias(n)]:
        del sys.modules[name]


_SHIM = '''"""Generated by `meshspeed run --deepspeed-compat`: in this process `deepspeed` is meshspeed.
See Note [the deepspeed alias] in meshspeed/compat/alias.py."""
from meshspeed.compat.alias import install

install()
'''


def write_shim(directory: str) -> str:
    """Write the `deepspeed` shim package into `directory` (to be put first on PYTHONPATH);
    returns the package's path."""
    package = os.path.join(directory, ALIAS)
    os.makedirs(package, exist_ok=True)
    with open(os.path.join(package, "__init__.py"), "w") as f:
        f.write(_SHIM)
    return package
