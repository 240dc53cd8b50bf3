"""Where the "meshspeed" logger's lines go when the program did not say.

Note [meshspeed's own handler]
DeepSpeed users expect rank 0 to say what it built and how training goes, without
configuring logging first. A library that installs handlers at import is rude, so
`speak(level)` runs at `initialize` (and before long work that reports progress), and
only when the program left logging alone: no handler on the root logger, and no handler
or level of its own on the "meshspeed" logger. It then attaches one handler to the
"meshspeed" logger: rank 0 writes INFO and above (other ranks WARNING and above), INFO
lines to stdout, warnings and errors to stderr (where Python's last-resort handler put
them before), and the logger stops propagating, so a `logging.basicConfig` made later
cannot print a line twice. A program that configured logging is left as it is; if it
configures logging after an earlier `initialize`, the next `initialize` takes the handler
away again (and the level it set, unless the program put a handler of its own on the
"meshspeed" logger) and the lines go to the program's handlers. Calling `speak` again only sets
the level.

The level: the environment variable MESHSPEED_LOG_LEVEL (debug, info, warning, error)
wins over the config key `log_level`, whose default is "info"; "warning" quiets the
banner, the `steps_per_print` lines and the progress reports. A level given explicitly
(either way) is also set on a "meshspeed" logger the program configured, unless it set a
level there itself.
"""

from __future__ import annotations

import logging
import os
import sys

from meshspeed import comm

LEVELS = ("debug", "info", "warning", "error")
ENV = "MESHSPEED_LOG_LEVEL"
log = logging.getLogger("meshspeed")


class MeshspeedHandler(logging.Handler):
    """INFO and below to the current sys.stdout, WARNING and above to sys.stderr (read at
    each line, so a redirected stream is followed)."""

    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.setFormatter(logging.Formatter("[meshspeed] %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
        try:
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own rule: a failed line never raises
            self.handleError(record)


def rank() -> int:
    """This process's rank: the process group's, else the launcher's RANK, else 0."""
    if comm.is_initialized():
        return comm.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def env_level() -> str | None:
    """MESHSPEED_LOG_LEVEL, checked; None when unset."""
    value = os.environ.get(ENV, "").strip().lower()
    if not value:
        return None
    if value not in LEVELS:
        raise ValueError(f"{ENV}={os.environ[ENV]!r} is not a log level; use one of {', '.join(LEVELS)}")
    return value


def _ours() -> list[logging.Handler]:
    return [h for h in log.handlers if isinstance(h, MeshspeedHandler)]


def _user_configured() -> bool:
    others = [h for h in log.handlers if not isinstance(h, MeshspeedHandler)]
    return bool(logging.getLogger().handlers or others or (log.level != logging.NOTSET and not _ours()))


def speak(level: str | None = None) -> None:
    """Note [meshspeed's own handler]. `level`: the config's `log_level` when it was given
    (None: the default, "info"); MESHSPEED_LOG_LEVEL wins over it."""
    chosen = env_level() or level
    name = (chosen or "info").upper()
    if _user_configured():
        ours = _ours()
        for handler in ours:  # logging was configured since an earlier initialize
            log.removeHandler(handler)
            log.propagate = True
        if ours and not log.handlers:  # configured at the root only: our level goes too
            log.setLevel(logging.NOTSET)
        if chosen is not None and log.level == logging.NOTSET:
            log.setLevel(name)
        return
    own = logging.getLevelName(name) if rank() == 0 else max(logging.WARNING, logging.getLevelName(name))
    handlers = _ours()
    if handlers:
        handlers[0].setLevel(own)
    else:
        log.addHandler(MeshspeedHandler(own))
    log.setLevel(own)
    log.propagate = False


def speaks_info() -> bool:
    """Whether an INFO line of the "meshspeed" logger is shown somewhere (progress asks)."""
    return log.isEnabledFor(logging.INFO) and log.hasHandlers()


def speak_default() -> None:
    """`speak()` unless logging is configured already, by the program or by an earlier
    `initialize` (whose `log_level` stays): for work that reports before or without one."""
    if not (_user_configured() or _ours()):
        speak()
