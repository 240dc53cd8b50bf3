"""The docs' pictures and commands are real: every image in docs/images is shown by a doc,
every image a doc shows exists, and every command quoted in docs/*.md and README.md still
parses: its script, module or `meshspeed` subcommand answers `--help`, and knows every
`--option` the docs quote with it (tests/docs/quoted.py says what counts as a command).

`meshspeed` subcommands are checked in this process through the CLI's own parsers; the
scripts and modules in one subprocess (tests/docs/help_runner.py), one `--help` each.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import subprocess
import sys
from collections import defaultdict

import pytest

from meshspeed import cli
from tests.docs import quoted
from tests.docs.quoted import REPO, Command, commands_in, doc_files, images_in

IMAGES = REPO / "docs" / "images"
USER_SCRIPT_DIRS = ("benchmarks/", "examples/", "tests/", "meshspeed/")  # other paths are the reader's own


def _quoted() -> dict[tuple[str, str], list[Command]]:
    found: dict[tuple[str, str], list[Command]] = defaultdict(list)
    for path in doc_files():
        for cmd in commands_in(path):
            if cmd.kind == "script" and not cmd.target.startswith(USER_SCRIPT_DIRS):
                continue  # `python train.py`: the reader's script
            found[(cmd.kind, cmd.target)].append(cmd)
    return found


QUOTED = _quoted()


def _known(option: str, options: set[str]) -> bool:
    """argparse also takes a unique prefix of a long option."""
    return option in options or len([o for o in options if o.startswith(option)]) == 1


def _unknown_options(cmds: list[Command], options: set[str]) -> list[str]:
    return sorted({f"{o} ({c.source})" for c in cmds for o in c.options if not _known(o, options)})


def _has_cli(kind: str, target: str) -> bool:
    """Whether `--help` can be asked of it: a script or module without argparse or a
    `--help` of its own (an example that just trains) would run its work instead."""
    path = REPO / target if kind == "script" else REPO / (target.replace(".", "/") + ".py")
    if kind == "module" and not path.is_file():
        path = path.with_suffix("") / "__main__.py"
    source = path.read_text() if path.is_file() else ""
    return "ArgumentParser" in source or "--help" in source


def test_every_image_is_shown_and_every_shown_image_exists():
    shown, missing = set(), []
    for path in doc_files():
        for ref, target in images_in(path):
            shown.add(target)
            if not target.is_file():
                missing.append(f"{path.relative_to(REPO)}: {ref}")
    assert missing == [], f"image references that point at no file: {missing}"
    unshown = sorted(p.name for p in IMAGES.iterdir() if p.resolve() not in shown) if IMAGES.is_dir() else []
    assert unshown == [], f"images in docs/images that no doc shows (show them or delete them): {unshown}"


def test_the_docs_quote_commands_of_each_kind():
    """The scanner finds what it must (a scanner that finds nothing would pass everything)."""
    kinds = {kind for kind, _ in QUOTED}
    assert kinds == {"meshspeed", "script", "module"}, kinds
    assert ("script", "benchmarks/pipeline.py") in QUOTED and ("meshspeed", "estimate") in QUOTED


@pytest.mark.parametrize("name", sorted({t for k, t in QUOTED if k == "meshspeed"}))
def test_meshspeed_subcommand_parses(name):
    cmds = QUOTED[("meshspeed", name)]
    assert name in cli._COMMANDS, f"{cmds[0].source} quotes `meshspeed {name}`, which is no subcommand " \
        f"(known: {', '.join(cli._COMMANDS)})"
    module = importlib.import_module(cli._COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"meshspeed {name}")
    module.add_arguments(parser)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
        parser.parse_args(["--help"])
    assert stop.value.code == 0 and f"meshspeed {name}" in out.getvalue()
    if getattr(module, "PASSTHROUGH", False):
        return  # `run` hands the options it does not know to torchrun
    unknown = _unknown_options(cmds, set(parser._option_string_actions))
    assert unknown == [], f"`meshspeed {name}` has no such options: {unknown}"


def test_quoted_scripts_and_modules_parse(tmp_path):
    targets = sorted((k, t) for k, t in QUOTED if k != "meshspeed")
    missing = [f"{t} ({QUOTED[(k, t)][0].source})" for k, t in targets if k == "script" and not (REPO / t).is_file()]
    assert missing == [], f"the docs quote scripts that do not exist: {missing}"
    targets = [(k, t) for k, t in targets if _has_cli(k, t)]
    out = tmp_path / "help.json"
    subprocess.run([sys.executable, str(REPO / "tests" / "docs" / "help_runner.py"), str(out),
                    *(f"{k}:{t}" for k, t in targets)], cwd=REPO, check=True, timeout=120,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    results = json.loads(out.read_text())
    failed = {spec: r["output"][-400:] for spec, r in results.items() if r["code"] != 0}
    assert failed == {}, f"`--help` failed: {failed}"
    unknown = {f"{k}:{t}": bad for k, t in targets
               if results[f"{k}:{t}"]["options"]
               and (bad := _unknown_options(QUOTED[(k, t)], set(results[f"{k}:{t}"]["options"])))}
    assert unknown == {}, f"the docs quote options these commands do not have: {unknown}"


def test_the_scanner_reads_blocks_continuations_and_inline_code(tmp_path, monkeypatch):
    monkeypatch.setattr(quoted, "REPO", tmp_path)
    doc = tmp_path / "x.md"
    doc.write_text("Run `meshspeed estimate --params 7e9\n--dp 8` or `import meshspeed as deepspeed`.\n\n"
                   "```bash\n$ PYTHONPATH=. .venv/bin/python benchmarks/a.py --one 1 \\\n    --two | tee log\n"
                   "python -m pytest -q && python -m meshspeed.launcher.guard --help\n```\n\n"
                   "    meshspeed run --nproc 2 train.py --deepspeed_config ds.json\n\n"
                   "![a](images/a.png) <img src=\"images/b.png\">\n")
    got = {(c.kind, c.target, c.options) for c in quoted.commands_in(doc)}
    assert got == {("meshspeed", "estimate", ("--params", "--dp")),
                   ("script", "benchmarks/a.py", ("--one", "--two")),
                   ("module", "meshspeed.launcher.guard", ("--help",)),
                   ("meshspeed", "run", ("--nproc",))}
    assert [ref for ref, _ in quoted.images_in(doc)] == ["images/a.png", "images/b.png"]
