"""Checked on every host before a job starts: does the master address work from here?

    python -m meshspeed.launcher.preflight node0

prints ``ok <address>`` when `node0` resolves on this host to an address that is not
loopback, else ``problem <what is wrong>`` (and exits 1), after a ``warning ...`` line when
this host's own name resolves to loopback only (gloo would listen there); the launcher gathers every host's
answer and makes one sentence of a problem (`sentence`). A master name that does not
resolve, or resolves to a loopback address (Debian's /etc/hosts maps the machine's own
name to 127.0.1.1), makes gloo on the other hosts connect to themselves ("Connection
refused 127.0.0.1") while node 0 waits without a word.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys


def _resolve(name: str) -> tuple[list[str], list[str], str | None]:
    """(every address `name` resolves to here, the loopback ones, the resolver's error)."""
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as err:
        return [], [], err.strerror
    addrs = list(dict.fromkeys(info[4][0] for info in infos))
    return addrs, [a for a in addrs if ipaddress.ip_address(a.split("%")[0]).is_loopback], None


def check_master(master: str) -> tuple[str | None, str | None]:
    """(the address `master` resolves to here, None) or (None, what is wrong with it)."""
    addrs, loopback, error = _resolve(master)
    if error is not None:
        return None, f"does not resolve ({error})"
    if loopback:
        return None, f"resolves to the loopback address {loopback[0]}, which other hosts cannot reach"
    return addrs[0], None


def own_name_warning(environ) -> str | None:
    """A warning when this host's own name resolves to loopback only and GLOO_SOCKET_IFNAME
    is unset: gloo then listens on loopback, where no other host reaches it."""
    name = socket.gethostname()
    addrs, loopback, error = _resolve(name)
    if environ.get("GLOO_SOCKET_IFNAME") or error is not None or len(loopback) < len(addrs):
        return None
    return (f"this host's own name {name!r} resolves to the loopback address {loopback[0]} only, so gloo "
            "listens where no other host reaches it; map the name to this host's network address in "
            "/etc/hosts, or set GLOO_SOCKET_IFNAME (in .deepspeed_env)")


def sentence(host: str, master: str, problem: str, example: str | None) -> str:
    """The one sentence `meshspeed run` prints for a host where the master does not work."""
    hint = f", e.g. --master_addr {example}" if example else " (--master_addr)"
    return f"meshspeed run: on {host}, the master address {master!r} {problem}; use an address every host resolves{hint}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshspeed.launcher.preflight")
    parser.add_argument("master")
    args = parser.parse_args(argv)
    warning = own_name_warning(os.environ)
    if warning:
        print(f"warning {warning}", flush=True)
    addr, problem = check_master(args.master)
    print(f"ok {addr}" if problem is None else f"problem {problem}", flush=True)
    return 0 if problem is None else 1


if __name__ == "__main__":
    sys.exit(main())
