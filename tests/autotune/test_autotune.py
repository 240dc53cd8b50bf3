"""`meshspeed autotune` end to end on 2 gloo ranks: a tiny GPT script is probed, the
planner's top layouts run as their own jobs, a crashing layout is recorded and skipped,
and best_config.json is the fastest measured trial's config."""

from __future__ import annotations

import json
import textwrap

import pytest

from meshspeed.autotune import TuneError, autotune
from meshspeed.autotune.pick import pick, within_noise
from meshspeed.autotune.report import Trial
from meshspeed.autotune.trial import find_config_arg, substitute
from meshspeed.config import ConfigError, load_config

SCRIPT = textwrap.dedent('''
    import argparse, json
    import torch
    import meshspeed
    from meshspeed.models.gpt import GPT, GPTConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed_config")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = json.load(open(args.deepspeed_config))
    if cfg.get("zero_optimization", {}).get("stage") == CRASH_STAGE:
        raise RuntimeError("this script refuses ZeRO stage %d" % CRASH_STAGE)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, max_seq_len=16, n_layer=2, n_head=2, d_model=32))
    engine, *_ = meshspeed.initialize(args=args, model=model)
    for _ in range(args.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            x = torch.randint(0, 64, (engine.train_micro_batch_size_per_gpu(), 16))
            loss = engine(x, x)
            engine.backward(loss)
            engine.step()
    if engine.global_rank == 0:  # which config the finished run used
        open(args.deepspeed_config + ".ran", "w").write("done")
''')


def _setup(tmp_path, crash_stage=-1, autotuning=None):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace("CRASH_STAGE", str(crash_stage)))
    cfg = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "autotuning": {"enabled": True, "start_profile_step": 1, "end_profile_step": 3,
                          **(autotuning or {})}}
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    return str(script), ["--deepspeed_config", str(tmp_path / "ds.json")]


def test_tune_two_ranks_crash_recorded_best_is_fastest(tmp_path, capsys):
    # Stage 1 crashes in this script. Micro-batches are held at 4, so the candidates are
    # ZeRO stages 0-3 at 4 x 1 and the top 3 include stage 1 (stage 3, with the most
    # traffic, is predicted slowest): the search must record it and go on.
    script, args = _setup(tmp_path, crash_stage=1, autotuning={
        "min_train_micro_batch_size_per_gpu": 4, "max_train_micro_batch_size_per_gpu": 4})
    out = autotune(script, args, nproc=2, top_k=3, timeout=120, results=str(tmp_path / "res"))
    trials = out["trials"]
    assert len(trials) == 3 and {t.keys["train_micro_batch_size_per_gpu"] for t in trials} == {4}
    crashed = [t for t in trials if t.keys["zero_optimization.stage"] == 1]
    ok = [t for t in trials if t.status == "ok"]
    assert crashed and all(t.status == "failed" and "refuses ZeRO stage 1" in t.reason for t in crashed)
    assert len(ok) == len(trials) - len(crashed) >= 1
    fastest = max(ok, key=lambda t: t.samples_per_second)
    if out["within_noise"]:  # the measurements cannot tell them apart: the fewest bytes is kept (pick.py)
        assert within_noise(out["best"], fastest) and f"{out['best'].layout} because" in out["within_noise"]
        fastest = out["best"]
    assert out["best"] is fastest
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("meshspeed autotune: ")]
    assert said[0].startswith("meshspeed autotune: probing ") and "3 trial(s) on 2 process(es)" in said[1]
    assert any(line.startswith("meshspeed autotune: trial 3/3: ") and " s/step (single steps " in line
               for line in said), said
    best = json.loads((tmp_path / "res" / "best_config.json").read_text())
    trial_cfg = json.loads((tmp_path / "res" / "autotuning_exps" / fastest.name / "ds_config.json").read_text())
    assert best == trial_cfg == fastest.config
    assert best["zero_optimization"]["stage"] == fastest.keys["zero_optimization.stage"]
    assert best["optimizer"]["params"]["lr"] == 1e-3 and "autotuning" not in best  # the user's keys kept
    loaded = load_config(best, dp_world_size=2)
    assert loaded.train_micro_batch_size_per_gpu == fastest.keys["train_micro_batch_size_per_gpu"]
    assert loaded.train_batch_size == 8
    for t in ok:  # figures are measured, per rank batch = micro x accumulation x dp = 8
        assert t.step_seconds > 0 and t.peak_memory_bytes > 0
        assert t.samples_per_second == pytest.approx(8 / t.step_seconds)
        assert t.tokens_per_second == pytest.approx(16 * t.samples_per_second)
    summary = json.loads((tmp_path / "res" / "summary.json").read_text())
    assert summary["best"] == fastest.name and summary["model"]["seq_len"] == 16
    assert [t["status"] for t in summary["trials"]] == [t.status for t in trials]
    assert "refuses ZeRO stage 1" in (tmp_path / "res" / "summary.md").read_text()


def test_run_autotuning_run_tunes_then_launches_best(tmp_path, monkeypatch):
    # DeepSpeed's launcher flag: tune (one trial, one rank), then train with best_config.json
    from meshspeed.cli import main

    script, args = _setup(tmp_path, autotuning={"tuner_num_trials": 1})
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--autotuning", "run", "--nproc_per_node", "1", script, *args, "--steps", "3"]) == 0
    best = tmp_path / "autotuning_results" / "best_config.json"
    summary = json.loads((tmp_path / "autotuning_results" / "summary.json").read_text())
    assert [t["status"] for t in summary["trials"]] == ["ok"]
    assert json.loads(best.read_text())["train_batch_size"] == 8
    assert (tmp_path / "autotuning_results" / "best_config.json.ran").is_file()  # the launch used it
    assert not (tmp_path / "ds.json.ran").exists()
    assert main(["run", "--autotuning", "sweep", script, *args]) == 2


def test_unknown_autotuning_key_refused_with_suggestion():
    with pytest.raises(ConfigError, match="autotuning.tuner_num_trails: unknown key; did you mean 'tuner_num_trials'"):
        load_config({"autotuning": {"tuner_num_trails": 3}})
    with pytest.raises(ConfigError, match="end_profile_step"):
        load_config({"autotuning": {"start_profile_step": 5, "end_profile_step": 5}})
    cfg = load_config({"autotuning": {"enabled": True, "metric": "latency", "arg_mappings": {"a": "--a"}}})
    assert cfg.autotuning.metric == "latency" and cfg.autotuning.end_profile_step == 5


def test_config_argument_substitution():
    assert find_config_arg(["--x", "1", "--deepspeed_config=a.json"]) == "a.json"
    assert find_config_arg(["--config", "b.json"]) == "b.json"
    cfg = {"train_micro_batch_size_per_gpu": 4}
    got = substitute(["--deepspeed_config", "a.json", "--mb", "1"], "t.json", cfg,
                     {"train_micro_batch_size_per_gpu": "--mb"})
    assert got == ["--deepspeed_config", "t.json", "--mb", "4"]
    with pytest.raises(TuneError, match="no --deepspeed_config/--config"):
        substitute(["--lr", "1"], "t.json", cfg, {})


def test_no_config_is_one_sentence(tmp_path):
    with pytest.raises(TuneError, match="no config"):
        autotune(str(tmp_path / "x.py"), ["--lr", "1"])


def test_timeout_and_out_of_memory_reasons(tmp_path):
    from meshspeed.autotune.trial import _reason, run_job

    script = tmp_path / "hang.py"
    script.write_text("import time\ntime.sleep(120)\n")
    result = run_job(str(script), [], 1, {}, tmp_path / "log.txt", timeout=5)
    assert not result.ok and result.reason == "timed out after 5 s"
    log = "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB\n"
    assert _reason(1, log) == "out of memory (exit 1)"
    assert _reason(1, "x\nValueError: bad micro-batch\n") == "exit 1: ValueError: bad micro-batch"


def _trial(layout, times, predicted_mb):
    t = Trial(f"t_{layout}", layout, {}, 1.0, predicted_mb * 2**20, status="ok", step_times=times)
    t.step_seconds = sum(times) / len(times)
    t.samples_per_second = 8 / t.step_seconds
    return t


def test_trials_within_noise_are_not_called_faster():
    a = _trial("dp2-zero2-mb4x1", [1.00, 1.10], 300)  # fastest on average
    b = _trial("dp2-zero3-mb4x1", [1.05, 1.20], 200)  # overlaps a, fewer bytes
    c = _trial("dp2-zero0-mb4x1", [1.50, 1.60], 100)  # clearly slower
    best, note = pick([a, b, c], "throughput")
    assert best is b
    assert note.startswith("within noise of each other (their single-step times overlap): "
                           "trial 1 dp2-zero2-mb4x1 (1.05 s/step, steps 1-1.1 s); trial 2 dp2-zero3-mb4x1")
    assert "picked trial 2 dp2-zero3-mb4x1 because it needs the fewest bytes (200 MB" in note
    assert "trial 1 scored best by throughput, by less than the noise" in note and "zero0" not in note
    a.step_times = [1.00, 1.01]  # now clearly ahead of b: a winner, no note
    assert pick([a, b, c], "throughput") == (a, "")
