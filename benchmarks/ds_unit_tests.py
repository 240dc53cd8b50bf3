"""DeepSpeed's own CPU unit tests, run on DeepSpeed 0.19.8 and on meshspeed through the alias.

    .venv/bin/python benchmarks/ds_unit_tests.py [--side ds|ms|both] [--only NAME] [--write-docs]

A measurement, not a test of the suite: nothing under tests/ depends on DeepSpeed's
repository. What it runs:
- DeepSpeed's `tests/` folder, exported (`git archive`) from a checkout of
  deepspeedai/DeepSpeed (`--repo`, default: the mirror the tool library fetches) at the tag
  of the anchor version (`--ref`, default v0.19.8; when the checkout has no such tag the
  newest commit is used and the table says which);
- the files of FILES, each in its own pytest process (DeepSpeed's CI runs them under
  `pytest --forked`; pytest-forked 1.7 cannot run DeepSpeed's class fixtures under pytest
  9, so one process per file is the isolation used), with DeepSpeed's own harness
  (`tests/conftest.py`, `tests/unit/common.py`'s DistributedTest) and LOCAL_SIZE=4, the
  CPU device count DeepSpeed's harness reads, so tests of 2 and 4 ranks run;
- once on the anchor venv (../shared/tools/anchor-venv.sh; ANCHOR_VENV overrides its
  folder; it needs pytest, pytest-timeout and hjson, which this script installs there if missing)
  with DS_ACCELERATOR=cpu, and once on this venv with the `deepspeed` alias in a folder on
  PYTHONPATH, written the way `meshspeed compat install` writes it.

Note [only what DeepSpeed runs]
Only tests that pass on DeepSpeed count, so the meshspeed side deselects the tests DeepSpeed
skipped on this machine (fp16 on CPU, CUDA-only ops, ...). That is also needed to finish:
DeepSpeed's harness cannot report pytest's own failures (`pytest.raises` that did not
raise, `pytest.fail`) from its rank processes, which are BaseExceptions its pool worker does
not pass back, so such a test waits out the per-test timeout (180 s here) instead of
failing, and breaks the shared rank pool for the tests after it. meshspeed, which supports
fp16 on CPU, would otherwise run DeepSpeed's fp16 cases that expect NotImplementedError.
The DeepSpeed side must therefore be run first (or be in the results file).

Results go to benchmarks/results/ds_unit_tests.json (one record per test and side); the
table (per file: tests, passing on DeepSpeed, passing on meshspeed, and each test that
passes on DeepSpeed and not on meshspeed with its reason) is printed, and with
`--write-docs` written into docs/deepspeed_compat.md between its markers. Tests that poke
DeepSpeed's internals no user calls are listed in INTERNALS with the reason and are not
counted as done.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "ds_unit_tests.json"
DOCS = REPO / "docs" / "deepspeed_compat.md"
START, END = "<!-- ds-unit-tests:start -->", "<!-- ds-unit-tests:end -->"
ANCHOR_VERSION = "0.19.8"
DEFAULT_REPO = Path("/work/.mirror/deepspeedai+DeepSpeed/repo")

# 29 files over the public surface: config parsing, initialize, LR schedulers, pipeline
# module / schedule / topology, activation checkpointing, MoE gating, comm, checkpoints and
# their conversion, ZeRO's config, no_sync
FILES = [
    "unit/runtime/test_ds_config_dict.py",
    "unit/runtime/test_ds_config_model.py",
    "unit/runtime/test_ds_initialize.py",
    "unit/runtime/test_lr_schedulers.py",
    "unit/checkpoint/test_lr_scheduler.py",
    "unit/runtime/pipe/test_pipe_schedule.py",
    "unit/runtime/pipe/test_topology.py",
    "unit/pipe/test_pipe_module.py",
    "unit/runtime/activation_checkpointing/test_activation_checkpointing.py",
    "unit/runtime/activation_checkpointing/test_activation_checkpointing_non_reentrant.py",
    "unit/v1/moe/test_moe.py",
    "unit/comm/test_dist.py",
    "unit/checkpoint/test_latest_checkpoint.py",
    "unit/checkpoint/test_tag_validation.py",
    "unit/checkpoint/test_other_optimizer.py",
    "unit/checkpoint/test_zero_optimizer.py",
    "unit/checkpoint/test_pipeline.py",
    "unit/checkpoint/test_shared_weights.py",
    "unit/checkpoint/test_moe_checkpoint.py",
    "unit/checkpoint/test_convert_checkpoint.py",
    "unit/runtime/zero/test_zero_config.py",
    "unit/runtime/test_no_sync_ctxt.py",
    "unit/runtime/test_runtime_utils.py",
    "unit/runtime/utils/test_partition.py",
    "unit/utils/test_groups.py",
    "unit/utils/test_partition_balanced.py",
    "unit/runtime/comm/test_coalesced_collectives.py",
    "unit/runtime/test_precision_config_loss_scale.py",
    "unit/runtime/test_data.py",
]

# test id patterns (regular expressions over "file::test") that exercise DeepSpeed's
# internals rather than its public API, with the reason; listed, not counted as done
INTERNALS: dict[str, str] = {
    r"unit/runtime/utils/test_partition.py::": "runtime.utils.partition_* and PartitionedTensor: pipeline-engine internals",
    r"unit/runtime/comm/test_coalesced_collectives.py::": "runtime.comm.coalesced_collectives: ZeRO-3's private collective helpers",
    r"unit/utils/test_partition_balanced.py::": "runtime.utils.partition_balanced: a pipeline-engine helper",
    r"unit/checkpoint/test_zero_optimizer.py::TestZeROElasticCheckpoint::test_elastic_checkpoint_fixed_dp\[True":
        "reads engine.optimizer.optimizer, the inner optimizer of DeepSpeed's ZeRO wrapper (meshspeed's "
        "engine.optimizer is that optimizer: Note [DeepSpeed's optimizer wrappers])",
    r"unit/checkpoint/test_zero_optimizer.py::TestZeRONonDistributed::test_chmod_exception_handling":
        "calls the engine's private _change_recovery_script_permissions",
    r"unit/runtime/test_runtime_utils.py::TestClipGradNorm::test_gather":
        "calls the private groups._create_expert_and_data_parallel",
    r"unit/runtime/test_runtime_utils.py::TestCheckOverflow::":
        "CheckOverflow (the fp16 optimizers' helper) and the private groups._create_expert_and_data_parallel",
    r"unit/runtime/test_runtime_utils.py::test_count_used_parameters":
        "count_used_parameters_in_backward, the ZeRO engine's backward-hook helper",
}


def anchor_python() -> str:
    return str(Path(os.environ.get("ANCHOR_VENV", Path.home() / ".cache/meshspeed-anchors")) / "bin/python")


def export_tests(repo: Path, ref: str | None, into: Path) -> str:
    """DeepSpeed's tests/ at `ref` (default: the anchor's tag, else the newest commit) in `into`;
    returns what was exported, for the table."""
    tags = subprocess.run(["git", "-C", str(repo), "tag"], capture_output=True, text=True, check=True).stdout.split()
    if ref is None:
        ref = f"v{ANCHOR_VERSION}" if f"v{ANCHOR_VERSION}" in tags else "HEAD"
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", ref], capture_output=True, text=True,
                            check=True).stdout.strip()
    version = subprocess.run(["git", "-C", str(repo), "show", f"{ref}:version.txt"], capture_output=True, text=True,
                             check=False).stdout.strip() or "?"
    archive = subprocess.run(["git", "-C", str(repo), "archive", ref, "tests"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "x", "-C", str(into)], input=archive, check=True)
    return f"{ref} ({commit}, version.txt {version})"


def ensure_pytest(python: str) -> None:
    """pytest and pytest-timeout run the files; hjson is imported by DeepSpeed's config tests
    (a DeepSpeed dependency, not meshspeed's): measurement-only, installed where missing."""
    probe = subprocess.run([python, "-c", "import pytest, pytest_timeout, hjson"], capture_output=True, check=False)
    if probe.returncode:
        subprocess.run([python, "-m", "pip", "install", "-q", "pytest", "pytest-timeout", "hjson"], check=True)


def side_env(side: str, shim: Path) -> dict[str, str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "OMP_NUM_THREADS": "1", "LOCAL_SIZE": "4",
           "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if side == "ms":
        env["PYTHONPATH"] = f"{shim}{os.pathsep}{REPO}"
    return env


def run_file(python: str, env: dict[str, str], tests_dir: Path, name: str, out: Path, timeout: int,
             deselect: list[str] = ()) -> list[dict]:
    xml = out / (name.replace("/", "_") + ".xml")
    command = [python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--timeout", "180",
               f"--junitxml={xml}", name, *(f"--deselect={t}" for t in deselect)]
    try:
        proc = subprocess.run(command, cwd=tests_dir, env=env, capture_output=True, text=True, timeout=timeout,
                              check=False)
        tail = (proc.stdout + proc.stderr)[-2000:]
    except subprocess.TimeoutExpired:
        tail = f"the file did not finish within {timeout} s"
    if not xml.exists():
        return [{"test": f"{name}::*", "outcome": "error", "reason": _first_line(tail)}]
    return parse_junit(xml, name)


def _first_line(text: str) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", text or "")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("E "):
            return ln[1:].strip()[:300]
    for ln in lines:
        if "Error" in ln or "error" in ln:
            return ln[:300]
    return (lines[-1] if lines else "")[:300]


def parse_junit(xml: Path, name: str) -> list[dict]:
    records = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        test = f"{name}::{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        if not case.get("classname", "").rsplit(".", 1)[-1].startswith("Test"):
            test = f"{name}::{case.get('name')}"
        outcome, reason = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                reason = _first_line((node.get("message") or "") + "\n" + (node.text or ""))
                break
        records.append({"test": test, "outcome": outcome, "reason": reason})
    if not records:  # an import error at collection leaves an error entry or nothing
        records.append({"test": f"{name}::*", "outcome": "error", "reason": "no test collected"})
    return records


def internal_reason(test: str) -> str | None:
    for pattern, reason in INTERNALS.items():
        if re.search(pattern, test):
            return reason
    return None


def table(results: dict, source: str) -> str:
    ds = {r["test"]: r for r in results.get("ds", [])}
    ms = {r["test"]: r for r in results.get("ms", [])}
    lines = [f"DeepSpeed's tests from {source}; {len(FILES)} files, each in its own pytest process, "
             "LOCAL_SIZE=4, on this 2-core CPU machine.", "",
             "| file | tests | pass on DeepSpeed 0.19.8 | pass on meshspeed | internals |",
             "|---|---:|---:|---:|---:|"]
    gaps, internals = [], []
    total = [0, 0, 0, 0]
    for name in FILES:
        # "file::*" stands for a file that reported no test (an import error): not a test
        names = sorted({t for t in [*ds, *ms] if t.startswith(name + "::") and not t.endswith("::*")})
        ds_pass = [t for t in names if ds.get(t, {}).get("outcome") == "passed"]
        ms_pass = [t for t in ds_pass if ms.get(t, {}).get("outcome") == "passed"]
        inner = [t for t in ds_pass if internal_reason(t)]
        row = [len(names), len(ds_pass), len(ms_pass), len(inner)]
        total = [a + b for a, b in zip(total, row)]
        lines.append(f"| `{name.removeprefix('unit/')}` | " + " | ".join(map(str, row)) + " |")
        for t in ds_pass:
            if t in ms_pass:
                continue
            why = internal_reason(t)
            got = ms.get(t) or ms.get(f"{name}::*") or {"outcome": "missing", "reason": "not run"}
            entry = f"- `{t.removeprefix('unit/')}`: {got['outcome']}: {got['reason'] or '(no message)'}"
            (internals if why else gaps).append(entry + (f" (internal: {why})" if why else ""))
    lines.append("| **all** | " + " | ".join(f"**{n}**" for n in total) + " |")
    lines += ["", f"Tests passing on DeepSpeed and not on meshspeed that use the public API: {len(gaps)}."]
    lines += gaps
    if internals:
        lines += ["", "Tests of DeepSpeed's internals (listed, not counted as done):", *internals]
    return "\n".join(lines)


def _head() -> str:
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def write_docs(text: str, ms_commit: str) -> None:
    doc = DOCS.read_text()
    block = (f"{START}\nmeshspeed at commit {ms_commit}; made with `python benchmarks/ds_unit_tests.py` (both "
             f"sides; `--side none --write-docs` writes this table from benchmarks/results/ds_unit_tests.json).\n\n"
             f"{text}\n{END}")
    if START in doc:
        doc = re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _: block, doc, flags=re.S)
    else:
        doc += f"\n## DeepSpeed's own unit tests\n\n{block}\n"
    DOCS.write_text(doc)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", type=Path, default=Path(os.environ.get("DEEPSPEED_REPO", DEFAULT_REPO)))
    p.add_argument("--ref", default=None)
    p.add_argument("--side", choices=("ds", "ms", "both", "none"), default="both",
                   help="none: no run, the table from the results file")
    p.add_argument("--only", default=None, help="run only the files whose path contains this")
    p.add_argument("--file-timeout", type=int, default=1800)
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args()

    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results = {"ds": previous.get("ds", []), "ms": previous.get("ms", []), "ms_commit": previous.get("ms_commit")}
    sides = {"both": ["ds", "ms"], "none": []}.get(args.side, [args.side])
    files = [f for f in FILES if args.only is None or args.only in f]
    source = previous.get("source", "?")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if sides:
            source = export_tests(args.repo, args.ref, tmp)
        shim = tmp / "alias"
        sys.path.insert(0, str(REPO))
        from meshspeed.compat.install import write_shim
        write_shim(str(shim))
        for side in sides:
            python = anchor_python() if side == "ds" else sys.executable
            ensure_pytest(python)
            kept = [r for r in results[side] if not any(r["test"].startswith(f + "::") for f in files)]
            for name in files:
                start = time.perf_counter()
                # Note [only what DeepSpeed runs]: a test DeepSpeed skips here is not run on meshspeed
                skipped = [r["test"] for r in results["ds"] if side == "ms" and r["outcome"] == "skipped"
                           and r["test"].startswith(name + "::")]
                records = run_file(python, side_env(side, shim), tmp / "tests", name, tmp, args.file_timeout,
                                   skipped)
                records += [{"test": t, "outcome": "deselected", "reason": "skipped on DeepSpeed"} for t in skipped]
                passed = sum(r["outcome"] == "passed" for r in records)
                print(f"[{side}] {name}: {passed}/{len(records)} passed ({time.perf_counter() - start:.0f} s)",
                      flush=True)
                kept += records
            results[side] = kept
            if side == "ms":
                results["ms_commit"] = _head()
    results["source"] = source
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    text = table(results, source)
    print(text)
    if args.write_docs:
        write_docs(text, results.get("ms_commit", "?"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
