"""Shared by the config tests."""

import pytest

from meshspeed.config import ConfigError, load_config


def error_of(config) -> str:
    """The ConfigError message `load_config(config)` raises (the test fails if none)."""
    with pytest.raises(ConfigError) as info:
        load_config(config)
    return str(info.value)
