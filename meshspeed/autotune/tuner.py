"""`autotune`: probe the script's model, rank layouts with the planner, measure the top
ones each in its own `meshspeed run` job, and keep the fastest (docs/autotune.md).

A trial that fails -- non-zero exit, out of memory, timeout, no figures -- is recorded
with its reason and the search goes on; only bad input (no config argument, a config
that does not load) stops it before any trial starts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from meshspeed.autotune import space, trial
from meshspeed.autotune.pick import pick, step_range
from meshspeed.autotune.report import Trial, write
from meshspeed.autotune.trial import TuneError
from meshspeed.config import MeshspeedConfig, load_config
from meshspeed.planner.model_spec import PlanModel, check_keys


def _precision(parsed: MeshspeedConfig) -> str:
    return "bf16" if parsed.bf16.enabled else "fp16" if parsed.fp16.enabled else "fp32"


def _probe(script: str, args: list[str], user: dict, exps: Path, timeout: float | None) -> dict[str, Any]:
    cfg_path, facts_path = exps / "probe_config.json", exps / "probe_facts.json"
    cfg_path.write_text(json.dumps(space.probe_config(user), indent=2) + "\n")
    facts_path.unlink(missing_ok=True)
    result = trial.run_job(script, trial.substitute(args, str(cfg_path), user, {}), 1,
                           trial.probe_env(facts_path), exps / "probe.log", timeout)
    if not facts_path.is_file():
        raise TuneError(f"the probe run of {script} did not reach meshspeed.initialize "
                        f"({result.reason or 'it exited without initializing'}); see {exps / 'probe.log'}")
    facts = json.loads(facts_path.read_text())
    if facts.get("model_config") is None:
        raise TuneError(f"the model ({facts['model_class']}) has no `config` the planner can read; "
                        "give its shape with --model config.json")
    return facts


def autotune(script: str, script_args: list[str], *, config: str | None = None, nproc: int = 1,
             top_k: int | None = None, steps: int | None = None, timeout: float | None = None,
             results: str | None = None, seq_len: int | None = None, model: str | None = None) -> dict[str, Any]:
    """Tune `script` (run as `meshspeed run --nproc_per_node nproc script script_args`).

    config: the DeepSpeed-format JSON (default: the script's --deepspeed_config/--config
    argument). top_k: trials (default: autotuning.tuner_num_trials if set, else 3).
    steps: end_profile_step (timing starts after start_profile_step). timeout: seconds
    per job. Returns {"best": Trial | None, "trials": [...], "best_config": dict | None}.
    """
    config = config or trial.find_config_arg(script_args)
    if config is None:
        raise TuneError("no config: give --config ds.json, or a --deepspeed_config PATH script argument")
    if not Path(config).is_file():
        raise TuneError(f"config {config!r} is not a file")
    user = json.loads(Path(config).read_text())
    parsed = load_config(user, dp_world_size=None)  # parsed once; `user` is what trials edit
    tune = parsed.autotuning
    start, end = tune.start_profile_step, tune.end_profile_step
    if steps is not None:
        if steps <= start:
            raise TuneError(f"--steps {steps} must be more than autotuning.start_profile_step ({start})")
        end = steps
    timeout = timeout or tune.trial_timeout or None
    results_dir = Path(results or tune.results_dir)
    if results_dir.joinpath("summary.json").exists() and not tune.overwrite:
        raise TuneError(f"{results_dir} already holds a summary and autotuning.overwrite is false; "
                        "move it or set overwrite true")
    exps = results_dir / tune.exps_dir if not Path(tune.exps_dir).is_absolute() else Path(tune.exps_dir)
    exps.mkdir(parents=True, exist_ok=True)
    for old in [*exps.glob("trial*"), *exps.glob("probe*")]:  # only what an earlier search wrote
        shutil.rmtree(old) if old.is_dir() else old.unlink()

    if model is None:
        say(f"probing {script}: one short run on 1 process reads the model and the sequence length")
    facts = _probe(script, script_args, user, exps, timeout) if model is None else {
        "model_config": json.loads(Path(model).read_text()), "seq_len": None}
    if model is not None:
        check_keys(facts["model_config"], model)  # a typo ('n_layers') named, with the key meant
    seq = seq_len or facts.get("seq_len") or facts["model_config"].get("max_seq_len")
    if not seq:
        raise TuneError("the sequence length is unknown (the probe saw no forward); give --seq-len")
    degrees = space.degrees(parsed)
    tp_pp_cp = degrees["tp"] * degrees["pp"] * degrees["cp"]
    if nproc % tp_pp_cp:
        raise TuneError(f"--nproc {nproc} is not a multiple of the config's model-parallel degrees ({tp_pp_cp})")
    base = load_config(parsed, dp_world_size=nproc // tp_pp_cp)
    batch = base.train_batch_size
    if batch < tune.min_train_batch_size or (tune.max_train_batch_size and batch > tune.max_train_batch_size):
        raise TuneError(f"train_batch_size {batch} is outside autotuning's [min_train_batch_size, "
                        f"max_train_batch_size] = [{tune.min_train_batch_size}, {tune.max_train_batch_size}]")
    k = top_k or (tune.tuner_num_trials if "tuner_num_trials" in tune.model_fields_set else 3)
    choices = space.rank_layouts(facts["model_config"], parsed, nproc=nproc, global_batch=batch,
                                 seq_len=int(seq), precision=_precision(parsed), top_k=k)
    if not choices:
        raise TuneError(f"the planner found no layout of this model on {nproc} ranks that fits "
                        f"{space.machine_memory(nproc) / 1e9:.1f} GB each within the autotuning bounds")
    flops_per_token = PlanModel.from_any(facts["model_config"]).train_flops_per_token
    say(f"{len(choices)} trial(s) on {nproc} process(es), each timing optimizer steps {start + 1}-{end}; "
        f"results in {results_dir}")
    trials, best, since = [], None, 0
    for i, ch in enumerate(choices):
        progress = f"trial {i + 1}/{len(choices)}: {ch.candidate.label()}"
        if since >= tune.tuner_early_stopping:  # no better layout in the last trials: stop
            t = Trial(_name(i, ch), ch.candidate.label(), space.layout_keys(ch),
                      ch.step_time, ch.memory["total"], status="skipped",
                      reason=f"early stopping: {since} trials without a better one")
            trials.append(t)
            say(f"{progress}: skipped ({t.reason})")
            continue
        say(f"{progress} (predicted {ch.step_time:.3g} s/step) ...")
        t = _measure(i, ch, user, script, script_args, tune, nproc, exps, start, end, timeout, int(seq),
                     flops_per_token)
        trials.append(t)
        say(f"{progress}: {_outcome(t)}")
        if t.status != "ok":
            continue
        if best is None or t.score(tune.metric) > best.score(tune.metric):
            best, since = t, 0
        else:
            since += 1
    best, noise = pick(trials, tune.metric)
    results_dir.mkdir(parents=True, exist_ok=True)
    if best is not None:
        (results_dir / "best_config.json").write_text(json.dumps(best.config, indent=2) + "\n")
    else:
        (results_dir / "best_config.json").unlink(missing_ok=True)
    text = write(results_dir, trials, best, tune.metric, {**facts, "seq_len": int(seq)}, noise)
    print(text, flush=True)
    return {"best": best, "trials": trials, "best_config": best.config if best else None, "table": text,
            "within_noise": noise, "results_dir": str(results_dir)}


def _measure(i, choice, user, script, script_args, tune, nproc, exps, start, end, timeout, seq, flops_per_token):
    keys = space.layout_keys(choice)
    cfg = space.trial_config(user, keys)
    t = Trial(_name(i, choice), choice.candidate.label(), keys,
              choice.step_time, choice.memory["total"], config=cfg)
    folder = exps / t.name
    folder.mkdir()
    (folder / "ds_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    try:
        args = trial.substitute(script_args, str(folder / "ds_config.json"), cfg, tune.arg_mappings)
    except TuneError as err:
        t.status, t.reason = "failed", str(err)
        return t
    prefix = folder / "metrics"
    run = trial.run_job(script, args, nproc, trial.trial_env(prefix, start, end), folder / "log.txt", timeout)
    figures = trial.read_metrics(prefix, nproc)
    if figures is None:
        t.status = "failed"
        t.reason = run.reason or f"exited before optimizer step {end} without figures (does it run {end} steps?)"
        return t
    t.status = "ok"
    t.step_seconds, t.samples_per_second = figures["step_seconds"], figures["samples_per_second"]
    t.peak_memory_bytes, t.step_times = figures["peak_memory_bytes"], figures["step_times"]
    t.tokens_per_second = t.samples_per_second * seq
    t.flops_per_second = t.tokens_per_second * flops_per_token(seq, recompute=choice.candidate.checkpointing)
    return t


def say(line: str) -> None:
    """A progress line: trials take minutes each, and the search should not look stuck."""
    print(f"meshspeed autotune: {line}", flush=True)


def _outcome(t: Trial) -> str:
    if t.status != "ok":
        return f"{t.status}: {t.reason}"
    r = step_range(t)
    spread = f" (single steps {r[0]:.3g}-{r[1]:.3g} s)" if r else ""
    return f"{t.step_seconds:.3g} s/step{spread}, {t.samples_per_second:.3g} samples/s, peak {t.peak_memory_bytes / 2**20:.0f} MB"


def _name(i: int, choice) -> str:
    return f"trial{i + 1}_" + choice.candidate.label().replace(" ", "_")
