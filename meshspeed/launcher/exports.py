"""What every host of a remote launch gets in its environment. Pure functions.

A remote shell starts from the remote machine's login environment, not from the launching
shell's, so the variables a job depends on are named and sent along:

- the variables of ``.deepspeed_env`` files (DeepSpeed's format: ``NAME=value`` per line),
  read from the home directory and then the current directory (a later file wins), the
  file name being ``$DS_ENV_FILE`` when that is set (an absolute path works too);
- the launching shell's ``PYTHONPATH`` and every ``NCCL_*`` and ``MESHSPEED_*`` variable.

``PATH`` is not sent (Note [PATH stays the host's own]).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

ENV_FILE_NAME = ".deepspeed_env"
EXACT = ("PYTHONPATH",)
PREFIXES = ("NCCL_", "MESHSPEED_")

# Note [PATH stays the host's own]
# The remote side starts Python by its absolute path (the launching interpreter's, as
# DeepSpeed does: every host has the same image), so nothing needs the launching PATH to
# find meshspeed. The launching PATH names directories of this machine (an activated
# virtualenv, a module system's tool paths, ~/bin) that may not exist, or hold other
# versions, on another host; sending it would make a remote `ssh`/`nvidia-smi`/compiler
# lookup depend on the launching machine. A job that needs it lists `PATH=...` in
# .deepspeed_env, which is sent as written.


class EnvFileError(ValueError):
    """A .deepspeed_env line that is not NAME=value."""


def parse_env_file(text: str, source: str) -> dict[str, str]:
    """``NAME=value`` lines -> {NAME: value}; blank lines and '#' comment lines skipped."""
    out: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        name = name.strip()
        if not sep or not name.isidentifier():
            raise EnvFileError(f"{source}:{number}: expected NAME=value, got {raw.strip()!r}")
        out[name] = value
    return out


def env_file_paths(environ: Mapping[str, str], cwd: str) -> list[str]:
    """Where .deepspeed_env files are looked for, in the order they apply."""
    name = environ.get("DS_ENV_FILE") or ENV_FILE_NAME
    home = environ.get("HOME") or os.path.expanduser("~")
    paths = [os.path.join(home, name), os.path.join(cwd, name)]
    return list(dict.fromkeys(os.path.abspath(p) for p in paths))


def read_env_files(environ: Mapping[str, str], cwd: str) -> dict[str, str]:
    """The variables of every .deepspeed_env file that exists (a later file wins)."""
    out: dict[str, str] = {}
    for path in env_file_paths(environ, cwd):
        if os.path.isfile(path):
            with open(path) as f:
                out.update(parse_env_file(f.read(), path))
    return out


def exports(environ: Mapping[str, str], cwd: str) -> dict[str, str]:
    """Every variable sent to the hosts: the launching shell's PYTHONPATH, NCCL_*,
    MESHSPEED_*, then the .deepspeed_env files' (which win)."""
    out = {k: v for k, v in environ.items() if k in EXACT or k.startswith(PREFIXES)}
    out.update(read_env_files(environ, cwd))
    return dict(sorted(out.items()))
