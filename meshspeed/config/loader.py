"""`load_config`: DeepSpeed JSON (path, dict or None) -> a resolved `MeshspeedConfig`."""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist
from pydantic import ValidationError

from meshspeed.config.batch import BATCH_KEYS, resolve_batch
from meshspeed.config.errors import ConfigError, problems_from_validation_error
from meshspeed.config.keys import check_keys
from meshspeed.config.root import MeshspeedConfig
from meshspeed.config.unbuilt import classify

logger = logging.getLogger("meshspeed")

ConfigSource = str | Path | dict[str, Any] | MeshspeedConfig | None


def load_config(
    config: ConfigSource = None, *, dp_world_size: int | None = 1, dp_source: str = "default"
) -> MeshspeedConfig:
    """Validate a DeepSpeed-format config and derive the batch triad.

    `config` is a path to a JSON file, a dict, an existing `MeshspeedConfig` (re-checked
    against this `dp_world_size`) or None (all defaults). `dp_world_size` is the
    data-parallel world size and `dp_source` says how it was found, for error messages.
    With `dp_world_size=None` the config is parsed once, before the data-parallel size is
    known (`initialize` reads the mesh's degrees from it): the batch numbers the user gave
    are kept as given and the triad is derived by a second call with the parsed config.
    Raises `ConfigError` listing every problem, one per line.
    """
    if isinstance(config, MeshspeedConfig):
        return config if dp_world_size is None else _recheck(config, dp_world_size, dp_source)
    raw = _read(config)
    checked = check_keys(raw, MeshspeedConfig)
    problems = list(checked.problems)
    unbuilt = classify(checked.unused, raw)
    problems.extend(unbuilt.problems)

    given = {k: checked.data.pop(k) for k in BATCH_KEYS if k in checked.data}
    triad: tuple[int, int, int] = (1, 1, 1)  # placeholder so other sections still get checked
    if dp_world_size is None:  # parsed before the mesh: the given numbers, derived later
        triad = tuple(given.get(k, 1) for k in BATCH_KEYS)
    else:
        try:
            triad = resolve_batch(given, dp_world_size, dp_source)
        except ConfigError as err:
            problems.extend(err.problems)
    try:
        cfg = MeshspeedConfig.model_validate({**checked.data, **dict(zip(BATCH_KEYS, triad))})
    except ValidationError as err:
        problems.extend(problems_from_validation_error(err))
    if problems:
        raise ConfigError(problems)

    cfg._batch_given = frozenset(given)
    cfg._ignored_keys = tuple(checked.unused)
    if _rank_zero():  # Note: once per job, not once per rank
        if unbuilt.monitors:
            logger.warning("config asks for monitors meshspeed does not have; they are off: %s",
                           "; ".join(unbuilt.monitors))
        if checked.autos:  # Note ["auto" values] in keys.py
            logger.info('config values left "auto" take their defaults: %s', ", ".join(checked.autos))
        if unbuilt.notes:
            logger.info("config keys accepted but not used by meshspeed yet: %s",
                        ", ".join(unbuilt.notes))
    return cfg


def _rank_zero() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _recheck(cfg: MeshspeedConfig, dp_world_size: int, dp_source: str) -> MeshspeedConfig:
    # Re-derive only the batch numbers the user did not give, for this world size.
    given = cfg.batch_keys_given
    data = cfg.to_dict()
    for key in BATCH_KEYS:
        if key not in given:
            del data[key]
    triad = resolve_batch({k: data[k] for k in given}, dp_world_size, dp_source)
    if triad == tuple(getattr(cfg, k) for k in BATCH_KEYS):
        return cfg
    new = cfg.model_copy(update=dict(zip(BATCH_KEYS, triad)))
    new._batch_given = given
    return new


def read_config(config: str | Path | dict[str, Any] | None) -> dict[str, Any]:
    """The raw contents of a config path or dict (a copy), before any checking; for code
    that reads one block of a DeepSpeed config on its own (compression.init_compression)."""
    return _read(config)


def _read(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        try:
            text = path.read_text()
        except OSError as err:
            raise ConfigError(f"cannot read config file {path}: {err.strerror or err}") from None
        try:
            data = _parse(text)
        except json.JSONDecodeError as err:
            raise ConfigError(
                f"{path}: not valid JSON: {err.msg} at line {err.lineno} column {err.colno}"
            ) from None
        except ConfigError as err:
            raise ConfigError(f"{path}: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the config must be a JSON object {{...}}")
        return data
    raise ConfigError(
        "config must be a path to a JSON file, a dict, a MeshspeedConfig or None "
        f"(got {type(config).__name__})"
    )


def _parse(text: str) -> Any:
    """JSON; or HJSON (comments, unquoted keys, optional commas), which DeepSpeed reads too,
    when the hjson package is installed. A text neither reads raises the JSON error."""
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as json_error:
        try:
            import hjson  # lazy: optional dependency (DeepSpeed depends on it, meshspeed does not)
        except ImportError:
            raise json_error from None
        try:
            return hjson.loads(text, object_pairs_hook=_no_duplicates)
        except hjson.HjsonDecodeError:
            raise json_error from None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json keeps the last of two equal keys silently; a config with both is a mistake.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"key '{key}' appears twice in the same object")
        out[key] = value
    return out
