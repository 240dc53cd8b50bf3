"""The SIGTERM report (Note [naming the dead rank when torchrun stops the job]); under
torchrun it is exercised by test_auto_resume.py, where rank 0 names the killed rank."""

from __future__ import annotations

import signal

from meshspeed.process import stopped


def test_installed_only_under_torchelastic():
    before = signal.getsignal(signal.SIGTERM)
    assert stopped.install_stop_report(environ={}) is False
    assert signal.getsignal(signal.SIGTERM) == before


def test_message_without_a_dead_peer_says_so():
    msg = stopped.stop_message(0, 2, "train.py:12 in main")
    assert msg.startswith("meshspeed: rank 0 stopped by the launcher (SIGTERM) at train.py:12 in main: ")
    assert "no rank on this host has died" in msg


def test_where_names_the_script_line_and_the_meshspeed_one():
    import sys

    here = stopped._where(sys._getframe())
    assert "test_stopped.py:" in here and "test_where_names" in here
