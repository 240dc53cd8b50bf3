"""`deepspeed` as another name for `meshspeed`, inside one process.

    install()                 # import deepspeed / from deepspeed.x.y import z -> meshspeed
    SHIM                      # the `deepspeed` package's source that calls install() when imported
                              # (written by compat/install.py)

Note [the deepspeed alias]
`meshspeed run --deepspeed-compat` puts a generated directory first on PYTHONPATH of the
processes it starts. The directory holds one package, `deepspeed`, whose __init__ calls
`install()`; so `import deepspeed` in the script finds it before any real DeepSpeed in
site-packages, and child processes the script starts (data-loader workers, subprocesses)
inherit the same environment. Without the flag nothing is added: a real DeepSpeed
installed alongside is used as usual.

`install()` does three things:
1. `sys.modules["deepspeed"]` becomes `meshspeed.compat.deepspeed`, the mirror of
   DeepSpeed's top-level module (the import statement that ran the shim returns whatever
   sys.modules holds at the end).
2. A finder first on `sys.meta_path` answers every `deepspeed.<path>` with the mirror's
   module, or meshspeed's own (Note [DeepSpeed's paths] in compat/paths.py), the same
   object: `sys.modules["deepspeed.moe.layer"] is sys.modules["meshspeed.moe.layer"]`,
   so isinstance checks and module-level state agree whichever name a line used. A path
   neither has is a `ModuleNotFoundError` saying so, naming the deepspeed module.
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
import os
import sys
from types import ModuleType

from meshspeed.compat.paths import MIRROR, Redirect

__all__ = ["ALIAS", "SHIM", "TARGET", "install", "is_installed", "uninstall"]

ALIAS = "deepspeed"
TARGET = "meshspeed"

_HINT = ("meshspeed stands in for DeepSpeed here (meshspeed run --deepspeed-compat); "
         "this part of DeepSpeed's API is not provided")


def _routes(alias_name: str) -> list[str]:
    """Note [DeepSpeed's paths]: the mirror's module first, then meshspeed's own package."""
    rest = alias_name[len(ALIAS):]
    return [MIRROR + rest, TARGET + rest] if rest else [MIRROR]


def _is_alias(name: str) -> bool:
    return name == ALIAS or name.startswith(ALIAS + ".")


def _not_provided(alias_name: str) -> ModuleNotFoundError:
    return ModuleNotFoundError(f"No module named {alias_name!r}: {_HINT} (neither {_routes(alias_name)[0]} "
                               f"nor {_routes(alias_name)[-1]} exists)", name=alias_name)


_finder = Redirect(ALIAS, _routes, _not_provided)
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
    returns the `deepspeed` module (meshspeed.compat.deepspeed). Idempotent."""
    global _original_import
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    if _original_import is None:
        _original_import = builtins.__import__
        builtins.__import__ = _import
    mirror = importlib.import_module(MIRROR)
    sys.modules[ALIAS] = mirror  # also replaces the shim whose import is running this
    return mirror


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


SHIM = '''"""Written by meshspeed (`meshspeed compat install`, `meshspeed run --deepspeed-compat`):
in this process `deepspeed` is meshspeed.
See Note [the deepspeed alias] in meshspeed/compat/alias.py."""
from meshspeed.compat.alias import install

install()
'''
