"""`meshspeed env` prints one screen and exits 0."""

from __future__ import annotations

import json

from meshspeed.cli import main


def test_env_report_prints(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for needle in ("[torch]", "gloo", "bf16", "O_DIRECT", "pydantic", "torch threads"):
        assert needle in out


def test_env_report_json(capsys):
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["distributed backends"]["gloo"] is True
    assert report["meshspeed"]["version"]
