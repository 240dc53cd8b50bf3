"""CommLogger (the `comms_logger` block): accumulation, filtering, the table."""

from __future__ import annotations

import logging

import pytest
import torch

from meshspeed import comm
from meshspeed.comm import CommLogger, counter
from meshspeed.testing import run_distributed

# Most behaviour is checked in-process by feeding the single counting hook directly.


def test_accumulates_calls_bytes_and_time():
    with CommLogger() as logger:
        counter.record("all_reduce", 6000, 0.002)
        counter.record("all_reduce", 2000, 0.001)
        counter.record("send", 100, 0.0005)
    counter.record("all_reduce", 1, 1.0)  # after stop: ignored
    summary = logger.summary()
    assert summary["all_reduce"]["calls"] == 2
    assert summary["all_reduce"]["bytes"] == 8000
    assert summary["all_reduce"]["seconds"] == pytest.approx(0.003)
    assert summary["send"]["bytes"] == 100
    assert summary["broadcast"] == {"calls": 0, "bytes": 0, "seconds": 0.0}


def test_format_table():
    with CommLogger() as logger:
        counter.record("all_reduce", 3 * 1024 * 1024, 0.004)
        counter.record("all_reduce", 1024 * 1024, 0.002)
        counter.record("all_gather", 512, 0.001)
    table = logger.format_table()
    lines = table.splitlines()
    assert lines[0].split() == [
        "comm",
        "op",
        "calls",
        "bytes",
        "avg",
        "size",
        "time",
        "ms",
        "avg",
        "ms",
    ]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert set(rows) == {"all_reduce", "all_gather", "total"}  # ops never called are omitted
    assert rows["all_reduce"][1:6] == ["2", "4.00", "MiB", "2.00", "MiB"]
    assert rows["all_reduce"][6:] == ["6.000", "3.000"]
    assert rows["all_gather"][1:4] == ["1", "512", "B"]
    assert rows["total"][1] == "3"


def test_empty_table():
    assert "no collectives" in CommLogger().format_table()


def test_prof_ops_filters_and_accepts_torch_names():
    with CommLogger(prof_ops=["all_gather_into_tensor", "isend"]) as logger:
        counter.record("all_gather", 10, 0.0)
        counter.record("send", 10, 0.0)
        counter.record("all_reduce", 10, 0.0)
    summary = logger.summary()
    assert summary["all_gather"]["calls"] == 1 and summary["send"]["calls"] == 1
    assert summary["all_reduce"]["calls"] == 0


def test_unknown_prof_op_suggests_a_name():
    with pytest.raises(ValueError, match="did you mean 'all_reduce'"):
        CommLogger(prof_ops=["allreduce"])


def test_disabled_logger_records_nothing():
    with CommLogger(enabled=False) as logger:
        counter.record("all_reduce", 10, 0.0)
    assert logger.summary()["all_reduce"]["calls"] == 0


def test_verbose_logs_every_call(caplog):
    with caplog.at_level(logging.INFO, logger="meshspeed.comm"), CommLogger(verbose=True):
        counter.record("broadcast", 300, 0.001)
    assert any("broadcast" in r.message and "300 bytes" in r.message for r in caplog.records)


def test_from_config_accepts_mapping_and_object():
    block = {"enabled": True, "verbose": True, "prof_all": False, "prof_ops": ["send"]}
    logger = CommLogger.from_config(block)
    assert logger.enabled and logger.verbose and logger.prof_ops == {"send"}
    # DeepSpeed semantics: prof_all (the default) wins over prof_ops.
    logger = CommLogger.from_config({"enabled": True, "prof_ops": ["send"]})
    assert logger.prof_ops == set(comm.COMM_OPS)

    class Block:
        enabled = False
        verbose = False
        prof_all = False
        prof_ops = ("all_reduce",)

    logger = CommLogger.from_config(Block())
    assert not logger.enabled and logger.prof_ops == {"all_reduce"}


def test_reset_clears_statistics():
    with CommLogger() as logger:
        counter.record("all_reduce", 10, 0.1)
        logger.reset()
        counter.record("all_reduce", 5, 0.1)
    assert logger.summary()["all_reduce"]["bytes"] == 5


def _real_collectives_body():
    logger = CommLogger().start()
    with comm.CommCounter() as count:
        comm.all_reduce(torch.ones(1000))
        comm.broadcast(torch.ones(10), src=0)
    logger.stop()
    return logger.summary(), count.summary(), logger.format_table()


def test_logger_and_counter_see_the_same_real_collectives():
    for summary, counts, table in run_distributed(_real_collectives_body, 2):
        for op in comm.COMM_OPS:
            assert summary[op]["calls"] == counts[op]["calls"]
            assert summary[op]["bytes"] == counts[op]["bytes"]
        assert summary["all_reduce"]["seconds"] > 0
        assert "all_reduce" in table and "broadcast" in table
