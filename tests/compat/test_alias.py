"""`import deepspeed` under --deepspeed-compat: the same module objects as meshspeed, and a
clear ImportError for what meshspeed does not provide. Run in a fresh interpreter with the
generated shim first on PYTHONPATH, as the launched processes have it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from meshspeed.compat import child
from meshspeed.compat.install import write_shim
from meshspeed.launcher import launch

ROOT = Path(__file__).resolve().parents[2]

PROBE = textwrap.dedent("""
    import json, sys
    out = {}
    import deepspeed
    import meshspeed
    import meshspeed.compat.deepspeed as mirror
    out["top"] = deepspeed is mirror and deepspeed.initialize is meshspeed.initialize
    from deepspeed.accelerator import get_accelerator
    import deepspeed.ops.adam
    from deepspeed import comm as dist
    import deepspeed.moe.layer, meshspeed.moe.layer
    import meshspeed.accelerator, meshspeed.ops.adam
    out["same"] = (sys.modules["deepspeed.accelerator"] is meshspeed.accelerator
                   and deepspeed.ops.adam is meshspeed.ops.adam
                   and dist.all_reduce is meshspeed.comm.all_reduce and callable(dist.init_distributed)
                   and deepspeed.moe.layer is meshspeed.moe.layer
                   and get_accelerator is meshspeed.accelerator.get_accelerator)
    out["spec"] = meshspeed.accelerator.__spec__.name  # not overwritten by the alias
    from deepspeed.pipe import PipelineModule
    from meshspeed.pipe import PipelineModule as P2
    out["class"] = PipelineModule is P2
    def error(statement):
        try:
            exec(statement, {})
        except ImportError as err:
            return [type(err).__name__, str(err), err.name]
        return None
    out["missing_module"] = error("import deepspeed.ops.transformer")
    out["missing_package"] = error("from deepspeed.nebula.constants import NEBULA_ENABLED")
    out["missing_name"] = error("from deepspeed.accelerator import get_accelerator, nonexistent_thing")
    out["missing_top"] = error("from deepspeed import DeepSpeedTransformerLayer")
    print(json.dumps(out))
""")


def run_probe(tmp_path, code: str, shim: bool = True) -> dict:
    path = [str(ROOT)]
    if shim:
        write_shim(str(tmp_path))
        path.insert(0, str(tmp_path))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120, check=False, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_deepspeed_names_are_meshspeed_modules_and_missing_names_say_so(tmp_path):
    out = run_probe(tmp_path, PROBE)
    assert out["top"] and out["same"] and out["class"]
    assert out["spec"] == "meshspeed.compat.deepspeed.accelerator"
    kind, message, name = out["missing_module"]
    assert kind == "ModuleNotFoundError" and name == "deepspeed.ops.transformer"
    assert "'deepspeed.ops.transformer'" in message and "not provided" in message
    kind, message, name = out["missing_package"]
    assert name == "deepspeed.nebula" and "meshspeed.nebula" in message and "not provided" in message
    kind, message, _ = out["missing_name"]
    assert kind == "ImportError"
    assert "'nonexistent_thing' from 'deepspeed.accelerator'" in message and "not provided" in message
    assert "'DeepSpeedTransformerLayer' from 'deepspeed'" in out["missing_top"][1]


def test_without_the_shim_deepspeed_is_not_meshspeed(tmp_path):
    out = run_probe(tmp_path, "import importlib.util, json\n"
                              "spec = importlib.util.find_spec('deepspeed')\n"
                              "print(json.dumps({'origin': spec and spec.origin}))", shim=False)
    assert out["origin"] is None or "meshspeed" not in out["origin"]


def test_only_compat_mode_changes_the_launched_environment(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    with launch._launch_environment({}, compat=False):
        assert os.environ["PYTHONPATH"] == "/somewhere"
    with launch._launch_environment({"CUDA_VISIBLE_DEVICES": "1"}, compat=True):
        first, rest = os.environ["PYTHONPATH"].split(os.pathsep, 1)
        assert rest == "/somewhere" and (Path(first) / "deepspeed" / "__init__.py").is_file()
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    assert os.environ["PYTHONPATH"] == "/somewhere" and "CUDA_VISIBLE_DEVICES" not in os.environ
    assert not Path(first).exists()  # the generated shim is removed after the run


@pytest.mark.parametrize(("local_rank", "expected"), [
    (True, ["train.py", "--local_rank=3", "--deepspeed", "--deepspeed_config", "c.json"]),
    (False, ["train.py", "--deepspeed", "--deepspeed_config", "c.json"]),
])
def test_child_passes_local_rank_like_the_deepspeed_launcher(local_rank, expected):
    args = ["--deepspeed", "--deepspeed_config", "c.json"]
    assert child.child_argv("train.py", args, {"LOCAL_RANK": "3"}, local_rank) == expected
    env = child.deepspeed_env({"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1"})
    assert env == {"LOCAL_SIZE": "2", "CROSS_RANK": "0", "CROSS_SIZE": "1"}


def test_first_statement_of_a_launched_script_gets_the_clear_error(tmp_path):
    """The rank's entry point installs the alias before the script's first line runs."""
    script = tmp_path / "first.py"
    script.write_text("import sys\n"
                      "try:\n"
                      "    from deepspeed.accelerator import get_accelerator, nonexistent_thing\n"
                      "except ImportError as err:\n"
                      "    print(sys.argv[1:], err)\n")
    write_shim(str(tmp_path))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), "LOCAL_RANK": "1"}
    proc = subprocess.run([sys.executable, "-m", "meshspeed.compat.child", str(script), "--x"],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("['--local_rank=1', '--x'] cannot import name 'nonexistent_thing' "
                                  "from 'deepspeed.accelerator'"), proc.stdout
    assert "not provided" in proc.stdout


def test_launched_script_gets_meshspeed_log_lines_on_stdout_as_deepspeed_prints_its_own(tmp_path):
    script = tmp_path / "logs.py"
    script.write_text("import logging\n"
                      "from deepspeed.utils import log_dist\n"
                      "log_dist('hello from the engine', ranks=[0])\n"
                      "logging.getLogger('meshspeed.engine').debug('below INFO')\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LOCAL_RANK": "0"}
    proc = subprocess.run([sys.executable, "-m", "meshspeed.compat.child", str(script)],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[INFO] [meshspeed] [rank 0] hello from the engine" in proc.stdout, proc.stdout
    assert "below INFO" not in proc.stdout + proc.stderr


def test_deepspeed_logging_leaves_a_configured_logger_alone():
    import logging

    configured = logging.getLogger("meshspeed-test-configured")
    configured.setLevel(logging.WARNING)
    assert child.deepspeed_logging(configured.name).handlers == []
    fresh = child.deepspeed_logging("meshspeed-test-fresh")
    assert fresh.level == logging.INFO and len(fresh.handlers) == 1 and not fresh.propagate
    assert child.deepspeed_logging(fresh.name).handlers == fresh.handlers  # once
