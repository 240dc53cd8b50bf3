"""`meshspeed compat install | uninstall | status`: `import deepspeed` is meshspeed in this
environment, for every launcher (`python`, `torchrun`, `accelerate launch`, `srun`, a
notebook), until uninstalled.

Note [the installed alias]
`install` writes two things into this interpreter's site-packages (`sysconfig`'s purelib,
the venv's when one is active), and nothing else:
- `deepspeed/__init__.py`, the shim of compat/alias.py: importing it installs the alias,
  so `import deepspeed` and `from deepspeed.x import y` give meshspeed's modules (Note
  [the deepspeed alias]);
- `deepspeed-<version>.dist-info/`, package metadata for a distribution named `deepspeed`:
  Hugging Face transformers and accelerate decide DeepSpeed is available when
  `importlib.util.find_spec("deepspeed")` finds a module *and*
  `importlib.metadata.metadata("deepspeed")` answers, and they compare
  `importlib.metadata.version("deepspeed")` with their minimums (0.9.3 and up, feature
  gates to 0.18.2). The version is meshspeed.version.DEEPSPEED_VERSION, e.g.
  `0.19.8+meshspeed.0.1.0`: the DeepSpeed release meshspeed matches, with meshspeed's own
  version as the local label, so it passes those checks and still says what it is.
  `INSTALLER` says `meshspeed`, and `RECORD` lists every file, so `pip uninstall
  deepspeed` removes it too.
`install` refuses when a `deepspeed` distribution that meshspeed did not write is installed
(a real DeepSpeed), or a `deepspeed` module of another origin is importable. `uninstall`
removes exactly the files RECORD lists (and the two folders, once empty), so the
environment is as it was before `install`. Both are idempotent.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata
import importlib.util
import sys
import sysconfig
from pathlib import Path

from meshspeed.compat.alias import ALIAS, SHIM
from meshspeed.version import DEEPSPEED_VERSION, __version__

__all__ = ["InstallError", "install", "installed_by_meshspeed", "status", "uninstall", "write_metadata",
           "write_shim"]

INSTALLER = "meshspeed"


class InstallError(RuntimeError):
    """The alias cannot be installed or removed here; the message says why."""


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def _dist_info_name() -> str:
    return f"{ALIAS}-{DEEPSPEED_VERSION}.dist-info"


def _metadata_text() -> str:
    return (f"Metadata-Version: 2.1\nName: {ALIAS}\nVersion: {DEEPSPEED_VERSION}\n"
            f"Summary: meshspeed {__version__} standing in for DeepSpeed: `import deepspeed` is "
            "meshspeed (installed by `meshspeed compat install`)\n"
            "Requires-Dist: meshspeed\n")


def _record_line(root: Path, path: Path) -> str:
    data = path.read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path.relative_to(root).as_posix()},sha256={digest},{len(data)}"


def write_metadata(root: Path, files: list[Path]) -> Path:
    """A `deepspeed` dist-info folder in `root` whose RECORD lists `files` and itself."""
    info = root / _dist_info_name()
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(_metadata_text())
    (info / "INSTALLER").write_text(INSTALLER + "\n")
    (info / "top_level.txt").write_text(ALIAS + "\n")
    listed = [*files, info / "METADATA", info / "INSTALLER", info / "top_level.txt"]
    (info / "RECORD").write_text("".join(_record_line(root, p) + "\n" for p in listed)
                                 + f"{(info / 'RECORD').relative_to(root).as_posix()},,\n")
    return info


def write_shim(directory: str) -> str:
    """The `deepspeed` shim package and its metadata in `directory`, to be put first on
    PYTHONPATH (`meshspeed run --deepspeed-compat`); returns the package's path."""
    package = Path(directory) / ALIAS
    package.mkdir(parents=True, exist_ok=True)
    shim = package / "__init__.py"
    shim.write_text(SHIM)
    write_metadata(Path(directory), [shim])
    return str(package)


def installed_by_meshspeed(dist: importlib.metadata.Distribution) -> bool:
    return (dist.read_text("INSTALLER") or "").strip() == INSTALLER


def _deepspeed_distribution() -> importlib.metadata.Distribution | None:
    try:
        return importlib.metadata.distribution(ALIAS)
    except importlib.metadata.PackageNotFoundError:
        return None


def status() -> str:
    """One line: whether `import deepspeed` is meshspeed here, and how."""
    dist = _deepspeed_distribution()
    if dist is None:
        return "not installed: `import deepspeed` is not meshspeed in this environment"
    if installed_by_meshspeed(dist):
        return (f"installed: `import deepspeed` is meshspeed {__version__} (reported as deepspeed "
                f"{dist.version}) in {site_packages()}")
    return f"a real DeepSpeed {dist.version} is installed here; `import deepspeed` is DeepSpeed"


def install(root: Path | None = None) -> list[Path]:
    """Note [the installed alias]; returns the files written (none when already installed)."""
    root = Path(root) if root is not None else site_packages()
    dist = _deepspeed_distribution()
    if dist is not None and not installed_by_meshspeed(dist):
        raise InstallError(f"a real DeepSpeed {dist.version} is installed in this environment "
                           f"({dist.locate_file('')}); uninstall it (pip uninstall deepspeed) or use "
                           "another environment, then run `meshspeed compat install` again")
    if dist is not None:
        return []
    spec = importlib.util.find_spec(ALIAS)
    if spec is not None and spec.origin is not None:
        raise InstallError(f"a `deepspeed` module is already importable from {spec.origin} with no "
                           "package metadata; remove it, then run `meshspeed compat install` again")
    package = root / ALIAS
    if package.exists():
        raise InstallError(f"{package} exists and is not meshspeed's; remove it first")
    write_shim(str(root))
    importlib.invalidate_caches()
    return [package / "__init__.py", *sorted((root / _dist_info_name()).iterdir())]


def uninstall(root: Path | None = None) -> list[Path]:
    """Remove what `install` wrote, exactly; returns the files removed."""
    root = Path(root) if root is not None else site_packages()
    dist = _deepspeed_distribution()
    if dist is None:
        return []
    if not installed_by_meshspeed(dist):
        raise InstallError(f"the `deepspeed` installed here is a real DeepSpeed {dist.version}, not "
                           "meshspeed's alias; `meshspeed compat uninstall` leaves it alone (pip uninstall "
                           "deepspeed removes it)")
    removed = []
    for entry in dist.files or []:
        path = Path(dist.locate_file(entry))
        if path.is_file():
            path.unlink()
            removed.append(path)
    for folder in (root / ALIAS / "__pycache__", root / ALIAS, root / _dist_info_name()):
        if folder.is_dir():
            for leftover in folder.glob("*.pyc"):
                leftover.unlink()
            folder.rmdir()
    importlib.invalidate_caches()
    return removed


# -- the command ------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("install", "uninstall", "status"),
                        help="install: `import deepspeed` is meshspeed in this environment; uninstall: "
                             "undo it; status: say which it is")


def main(args: argparse.Namespace) -> int:
    try:
        if args.action == "install":
            files = install()
            print(f"meshspeed compat: `import deepspeed` is now meshspeed in {site_packages()} "
                  f"(deepspeed {DEEPSPEED_VERSION}); undo with `meshspeed compat uninstall`"
                  if files else f"meshspeed compat: already installed ({status()})")
        elif args.action == "uninstall":
            files = uninstall()
            print(f"meshspeed compat: removed {len(files)} files; `import deepspeed` is no longer meshspeed"
                  if files else "meshspeed compat: nothing to remove (not installed)")
        else:
            print(f"meshspeed compat: {status()}")
    except InstallError as err:
        print(f"meshspeed compat {args.action}: {err}", file=sys.stderr)
        return 2
    return 0
