"""`meshspeed compat install | uninstall | status` (Note [the installed alias] in
compat/install.py) in a fresh virtual environment that sees this checkout and the dev
venv's packages through a .pth file: after install, `import deepspeed` is meshspeed for a
plain `python`, `importlib.metadata.version("deepspeed")` answers with a version that
passes transformers' and accelerate's checks and says it is meshspeed, and both libraries
call DeepSpeed available; uninstall leaves every file of the environment as it was; a real
DeepSpeed in the environment is refused in one sentence and left alone."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import importlib.metadata, json
import deepspeed
from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES
from packaging.version import Version
from transformers.integrations.deepspeed import is_deepspeed_available as hf_available
from accelerate.utils import is_deepspeed_available as accelerate_available
version = importlib.metadata.version("deepspeed")
print(json.dumps({"version": version, "module": deepspeed.__name__, "file": deepspeed.__file__,
                  "initialize": deepspeed.initialize.__module__, "hf": hf_available(),
                  "accelerate": accelerate_available(), "at_least": Version(version) >= Version("0.18.2"),
                  "schedules": sorted(VALID_LR_SCHEDULES)}))
"""


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    site = next(path.glob("lib/python*/site-packages"))
    (site / "meshspeed_dev.pth").write_text(f"{ROOT}\n{sysconfig.get_paths()['purelib']}\n")
    return path


def _python(venv: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"PATH": f"{venv / 'bin'}{os.pathsep}/usr/bin:/bin", "HOME": str(venv), "VIRTUAL_ENV": str(venv)}
    return subprocess.run([str(venv / "bin" / "python"), *args], capture_output=True, text=True, timeout=300,
                          check=False, env=env)


def _compat(venv: Path, action: str) -> subprocess.CompletedProcess:
    return _python(venv, "-m", "meshspeed.cli", "compat", action)


def _snapshot(venv: Path) -> dict[str, str]:
    return {str(p.relative_to(venv)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(venv.rglob("*"))}


def test_install_makes_deepspeed_meshspeed_and_uninstall_restores_the_environment(venv):
    import json

    before = _snapshot(venv)
    assert _python(venv, "-c", "import deepspeed").returncode != 0  # nothing to import yet
    first = _compat(venv, "install")
    assert first.returncode == 0 and "`import deepspeed` is now meshspeed" in first.stdout, first.stderr
    assert "already installed" in _compat(venv, "install").stdout  # idempotent
    assert "installed: `import deepspeed` is meshspeed" in _compat(venv, "status").stdout

    probe = _python(venv, "-c", PROBE)
    assert probe.returncode == 0, probe.stderr[-3000:]
    seen = json.loads(probe.stdout.strip().splitlines()[-1])
    assert seen["version"].startswith("0.19.8+meshspeed."), seen  # DeepSpeed's release, and what it is
    assert seen["at_least"] and seen["hf"] and seen["accelerate"], seen
    assert seen["file"] == str(ROOT / "meshspeed/compat/deepspeed/__init__.py"), seen  # meshspeed's tree
    assert seen["initialize"].startswith("meshspeed."), seen
    assert "OneCycle" in seen["schedules"] and "WarmupLR" in seen["schedules"], seen

    gone = _compat(venv, "uninstall")
    assert gone.returncode == 0 and "removed" in gone.stdout, gone.stderr
    assert _snapshot(venv) == before  # every file as it was, nothing left behind
    assert _python(venv, "-c", "import deepspeed").returncode != 0
    assert "nothing to remove" in _compat(venv, "uninstall").stdout


def test_a_real_deepspeed_is_refused_and_left_alone(venv):
    site = next(venv.glob("lib/python*/site-packages"))
    real = site / "deepspeed-0.19.8.dist-info"
    real.mkdir()
    (real / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.19.8\n")
    (real / "INSTALLER").write_text("pip\n")
    try:
        before = _snapshot(venv)
        for action in ("install", "uninstall"):
            proc = _compat(venv, action)
            assert proc.returncode == 2, proc.stdout + proc.stderr
            assert "real DeepSpeed 0.19.8" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
        assert "a real DeepSpeed 0.19.8 is installed here" in _compat(venv, "status").stdout
        assert _snapshot(venv) == before
    finally:
        for f in real.iterdir():
            f.unlink()
        real.rmdir()
