"""Where DeepSpeed's module paths are answered: one finder for two prefixes.

Note [DeepSpeed's paths]
DeepSpeed's public module tree (`deepspeed.runtime.zero.partition_parameters`,
`deepspeed.pipe`, `deepspeed.utils.groups`, ...) is mirrored by `meshspeed/compat/deepspeed/`
and by nothing else: the core never imports it (the import-linter contract in .importlinter
says so), and it holds only DeepSpeed's names over meshspeed's own objects. Two prefixes
reach it:

- `deepspeed.<path>`, once the alias is installed (compat/alias.py): the module
  `meshspeed.compat.deepspeed.<path>` when the mirror has one, else `meshspeed.<path>`
  (DeepSpeed paths that are meshspeed's own packages: `deepspeed.moe.layer`,
  `deepspeed.compression.compress`, `deepspeed.profiling.flops_profiler`, ...).
- `meshspeed.<name>[.<path>]` for the names DeepSpeed has and meshspeed's core does not
  (DEEPSPEED_NAMES: `meshspeed.zero`, `meshspeed.pipe`, `meshspeed.runtime.utils`, ...), so
  `import meshspeed as deepspeed` scripts and meshspeed's documented paths keep working.
  This finder is installed by `import meshspeed`; it answers only those names.

The finder hands the import system the module object already imported under its real
name, so each module exists once: `sys.modules["meshspeed.zero"] is
sys.modules["meshspeed.compat.deepspeed.zero"]`, and class identity and module state agree
whichever name a line used. A path the mirror lacks is a ModuleNotFoundError naming the
path the script asked for.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType

__all__ = ["DEEPSPEED_NAMES", "MIRROR", "Redirect", "install_meshspeed_names"]

MIRROR = "meshspeed.compat.deepspeed"
# DeepSpeed's top-level names that meshspeed's core does not own: `meshspeed.<name>` is the mirror's
DEEPSPEED_NAMES = ("accelerator", "arguments", "checkpointing", "git_version_info", "ops", "pipe",
                   "runtime", "utils", "zero")


def _exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent is missing, or is a module and not a package
        return False


class _Loader(importlib.abc.Loader):
    """Hands the import system an already-imported module."""

    def __init__(self, real_name: str):
        self.real_name = real_name
        self._spec = None

    def create_module(self, spec) -> ModuleType:
        module = importlib.import_module(self.real_name)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._spec  # the import system set it to the alias's spec


class Redirect(importlib.abc.MetaPathFinder):
    """Answers every module under `prefix` with the first existing module `routes(name)`
    names; `missing(name)` is the error when none exists."""

    def __init__(self, prefix: str, routes: Callable[[str], list[str]],
                 missing: Callable[[str], ImportError], only: tuple[str, ...] | None = None):
        self.prefix, self.routes, self.missing, self.only = prefix, routes, missing, only

    def handles(self, fullname: str) -> bool:
        if not (fullname == self.prefix or fullname.startswith(self.prefix + ".")):
            return False
        if self.only is None:
            return True
        head = fullname[len(self.prefix) + 1:].split(".", 1)[0]
        return head in self.only

    def find_spec(self, fullname, path=None, target=None):
        if not self.handles(fullname):
            return None
        for real in self.routes(fullname):
            if _exists(real):
                spec = importlib.util.find_spec(real)
                return importlib.util.spec_from_loader(fullname, _Loader(real),
                                                       is_package=spec.submodule_search_locations is not None)
        raise self.missing(fullname)


def _meshspeed_routes(fullname: str) -> list[str]:
    return [MIRROR + fullname[len("meshspeed"):]]


def _meshspeed_missing(fullname: str) -> ModuleNotFoundError:
    return ModuleNotFoundError(f"No module named {fullname!r} (DeepSpeed's paths are mirrored in "
                               f"{MIRROR}; this one is not provided)", name=fullname)


_meshspeed_finder = Redirect("meshspeed", _meshspeed_routes, _meshspeed_missing, only=DEEPSPEED_NAMES)


def install_meshspeed_names() -> None:
    """`meshspeed.<DeepSpeed name>` resolves to the mirror (called by `import meshspeed`)."""
    if _meshspeed_finder not in sys.meta_path:
        sys.meta_path.insert(0, _meshspeed_finder)
