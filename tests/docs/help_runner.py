"""Run `--help` of many scripts and modules in one interpreter (torch is imported once):

    python tests/docs/help_runner.py OUT.json script:benchmarks/x.py module:meshspeed.y ...

Each runs as `__main__` with argv `[name, "--help"]`; OUT.json maps each "kind:target" to
{"code": exit status, "output": the tail of what it printed, "options": every option string
of the argparse parsers it asked to parse}. A script that raises is code 1 with its
traceback as output.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import runpy
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


INSTALLED = tuple(str(Path(p).resolve()) for p in {sys.prefix, sys.base_prefix, *sys.path}
                  if "-packages" in p or p in (sys.prefix, sys.base_prefix))


def _repo_script_module(origin: str) -> bool:
    """A module loaded from the repository's own files outside meshspeed/ (a script's
    sibling), not an installed package: a virtual environment inside the checkout
    (`make install` puts .venv there) holds torch, which must never be imported twice."""
    if not origin:
        return False
    path = str(Path(origin).resolve())
    return (path.startswith(str(REPO)) and not path.startswith(str(REPO / "meshspeed"))
            and not path.startswith(INSTALLED))


def run_one(spec: str) -> dict:
    kind, target = spec.split(":", 1)
    parsers: list[argparse.ArgumentParser] = []
    original = argparse.ArgumentParser.parse_known_args

    def recording(self, args=None, namespace=None):
        parsers.append(self)
        return original(self, args, namespace)

    out = io.StringIO()
    saved_argv, saved_path, saved_modules = sys.argv, list(sys.path), set(sys.modules)
    argparse.ArgumentParser.parse_known_args = recording
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            if kind == "script":
                path = REPO / target
                sys.argv = [str(path), "--help"]
                sys.path.insert(0, str(path.parent))
                runpy.run_path(str(path), run_name="__main__")
            else:
                sys.argv = [target, "--help"]
                runpy.run_module(target, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if isinstance(stop.code, str):
            out.write(stop.code)
    except BaseException:  # noqa: BLE001 - any failure is this command's result, reported
        code = 1
        out.write(traceback.format_exc())
    finally:
        argparse.ArgumentParser.parse_known_args = original
        sys.argv, sys.path[:] = saved_argv, saved_path
        for name in set(sys.modules) - saved_modules:  # a sibling module of one script is not another's
            origin = getattr(sys.modules[name], "__file__", None) or ""
            if _repo_script_module(origin):
                del sys.modules[name]
    options = sorted({o for p in parsers for o in p._option_string_actions})
    return {"code": code, "output": out.getvalue()[-2000:], "options": options}


def main(argv: list[str]) -> None:
    out_path, specs = argv[0], argv[1:]
    Path(out_path).write_text(json.dumps({spec: run_one(spec) for spec in specs}))


if __name__ == "__main__":
    main(sys.argv[1:])
