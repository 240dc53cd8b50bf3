"""Several hosts on one machine, for tests of what crosses a network.

Note [hosts made of namespaces]
A `Cluster` makes N hosts. Each host is a Linux network namespace joined to a private
switch (a bridge in a namespace of its own) by a veth pair, with an address from
198.18.0.0/15 (RFC 2544's benchmarking range: never routed, and only this range is used),
and a "holder" process that owns the host's other namespaces:

* UTS: its own hostname (node0, node1, ...), so `socket.gethostname()` differs per host;
* PID: killing the holder (PID 1 inside) kills every process of the host at once, the way
  a machine that loses power takes its processes with it;
* mount: /etc/hosts is the host's own file (every host's name, in-place editable to make
  one host resolve names differently), `Cluster.local_path` is the host's own directory
  (a node-local disk: one path, different contents per host), and with `sshd=True` root's
  ~/.ssh holds a key generated for the test.

Everything else of the filesystem (the repository, the venv, `shared_path`) is seen by every
host, as machines booted from one image with an NFS home would. The machine's own network
and namespaces are never touched: nothing is added to the root namespace, and everything is
removed on exit. Commands run inside a host through `nsenter` into its holder.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

_IP, _UNSHARE, _NSENTER = shutil.which("ip"), shutil.which("unshare"), shutil.which("nsenter")
SSHD = "/usr/sbin/sshd"


class NamespaceError(RuntimeError):
    """The machine could not make the hosts; the message says which step failed."""


def _sh(*argv: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    if check and out.returncode != 0:
        raise NamespaceError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


def namespaces_available() -> tuple[bool, str]:
    """(True, "") where this process can make network, UTS, PID and mount namespaces;
    otherwise (False, the reason), for `pytest.skip`."""
    if os.geteuid() != 0:
        return False, "making network namespaces needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN)"
    missing = [n for n, p in (("ip (iproute2)", _IP), ("unshare", _UNSHARE), ("nsenter", _NSENTER)) if not p]
    if missing:
        return False, f"{', '.join(missing)} not installed"
    name = f"msprobe{os.getpid()}"
    try:
        _sh(_IP, "netns", "add", name)
        _sh(_IP, "netns", "del", name)
        _sh(_UNSHARE, "--uts", "--pid", "--mount", "--fork", "--mount-proc", "true")
    except (NamespaceError, OSError, subprocess.TimeoutExpired) as err:
        return False, f"this machine cannot make namespaces: {err}"
    return True, ""


def sshd_available() -> tuple[bool, str]:
    if not os.path.exists(SSHD) or not shutil.which("ssh") or not shutil.which("ssh-keygen"):
        return False, "OpenSSH server and client are not installed (Debian: apt-get install openssh-server)"
    return namespaces_available()


class Host:
    """One host of a Cluster; see Note [hosts made of namespaces]."""

    def __init__(self, cluster: Cluster, index: int):
        self.cluster, self.index = cluster, index
        self.name = f"node{index}"
        self.addr = f"{cluster.subnet}.{index + 1}"
        self.netns = f"{cluster.prefix}-{self.name}"
        self.disk = cluster.root / "disks" / self.name
        self.etc_hosts = cluster.root / "etc" / f"hosts-{self.name}"
        self._holder: subprocess.Popen | None = None
        self.pid1: int | None = None  # the holder's PID 1, seen from the machine

    # -- lifecycle ---------------------------------------------------------------------
    def boot(self, timeout: float = 15) -> None:
        """Start the host's holder (its UTS, PID and mount namespaces) inside its netns."""
        if self._holder is not None and self._holder.poll() is None:
            raise NamespaceError(f"{self.name} is running; kill() it before boot()")
        mounts = [f"mount --bind {self.etc_hosts} /etc/hosts",
                  f"mkdir -p {self.cluster.local_path}",
                  f"mount --bind {self.disk} {self.cluster.local_path}"]
        if self.cluster.sshd:
            mounts.append(f"mkdir -p /root/.ssh && mount --bind {self.cluster.root / 'dotssh'} /root/.ssh")
        script = "; ".join([f"hostname {self.name}", "set -e", *mounts, "echo up", "exec sleep infinity"])
        self._holder = subprocess.Popen(
            [_IP, "netns", "exec", self.netns, _UNSHARE, "--uts", "--pid", "--mount", "--fork",
             "--mount-proc", "--propagation", "private", "sh", "-c", script],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        line = self._holder.stdout.readline()  # bounded below by the child's own exit
        if line.strip() != "up":
            self._holder.kill()
            raise NamespaceError(f"{self.name} did not boot: {self._holder.stderr.read().strip()}")
        deadline = time.monotonic() + timeout
        while self.pid1 is None or not Path(f"/proc/{self.pid1}").exists():
            self.pid1 = self._find_pid1()
            if time.monotonic() > deadline:
                raise NamespaceError(f"{self.name}: its PID 1 did not appear within {timeout} s")
            time.sleep(0.05)
        if self.cluster.sshd:
            self._start_sshd()

    def _find_pid1(self) -> int | None:
        """The holder is `ip netns exec` -> unshare -> (fork) sh/sleep, PID 1 inside."""
        todo = [self._holder.pid]
        while todo:
            pid = todo.pop()
            try:
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            nspid = [ln.split()[1:] for ln in status.splitlines() if ln.startswith("NSpid:")]
            if nspid and len(nspid[0]) > 1 and nspid[0][-1] == "1":
                return pid
            todo += [int(c) for c in children]
        return None

    def kill(self) -> None:
        """SIGKILL every process of the host: PID 1 of its PID namespace dies, and the
        kernel kills the rest. The address, name and disk stay for boot()."""
        if self.pid1 is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid1, signal.SIGKILL)
        if self._holder is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._holder.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._holder.wait(timeout=10)
        self.pid1 = None

    @property
    def alive(self) -> bool:
        return self.pid1 is not None and self._holder is not None and self._holder.poll() is None

    # -- running commands --------------------------------------------------------------
    def command(self, argv: list[str], cwd: str | os.PathLike | None = None) -> list[str]:
        """`argv` as a command that runs inside this host (its namespaces, `cwd`)."""
        if not self.alive:
            raise NamespaceError(f"{self.name} is down; boot() it first")
        inner = ["env", "-C", str(cwd)] if cwd is not None else []
        return [_NSENTER, "-t", str(self.pid1), "--net", "--uts", "--pid", "--mount", "--", *inner, *argv]

    def popen(self, argv: list[str], *, env: dict[str, str] | None = None, cwd=None, **kwargs) -> subprocess.Popen:
        """Start `argv` inside this host. `env` is the whole environment (give PATH)."""
        kwargs.setdefault("start_new_session", True)
        return subprocess.Popen(self.command(argv, cwd), env=env, **kwargs)

    def run(self, argv: list[str], *, timeout: float = 60, env=None, cwd=None, check: bool = False,
            **kwargs) -> subprocess.CompletedProcess:
        """Run `argv` inside this host to the end (text output captured), bounded by `timeout`."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.command(argv, cwd), env=env, timeout=timeout, check=check, **kwargs)

    def processes(self) -> list[str]:
        """Command lines of every process of the host but its PID 1, read from the machine."""
        if self.pid1 is None:
            return []
        try:
            mine = os.readlink(f"/proc/{self.pid1}/ns/pid")
        except OSError:
            return []
        out = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == self.pid1:
                continue
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") != mine:
                    continue
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:
                continue
            if cmdline:
                out.append(cmdline)
        return out

    def _start_sshd(self) -> None:
        ssh = self.cluster.root / "ssh"
        config = ssh / f"sshd_config-{self.name}"
        config.write_text("\n".join([
            f"ListenAddress {self.addr}", "Port 22", f"HostKey {ssh / 'host_key'}",
            f"PidFile {ssh / f'sshd-{self.name}.pid'}", "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "UsePAM no", "StrictModes no", f"AuthorizedKeysFile {ssh / 'authorized_keys'}",
            "PrintMotd no", "LogLevel ERROR", "MaxStartups 64", "MaxSessions 64", "",
        ]))
        self.run(["mkdir", "-p", "/run/sshd"], timeout=10, check=True)
        self.popen([SSHD, "-D", "-e", "-f", str(config)], stdout=subprocess.DEVNULL,
                   stderr=open(ssh / f"sshd-{self.name}.log", "ab"))  # noqa: SIM115 - the child owns it
        deadline = time.monotonic() + 15
        while True:
            probe = self.run(["bash", "-c", f"exec 3<>/dev/tcp/{self.addr}/22"], timeout=10)
            if probe.returncode == 0:
                return
            if time.monotonic() > deadline:
                log = (ssh / f"sshd-{self.name}.log").read_text(errors="replace")
                raise NamespaceError(f"sshd on {self.name} did not listen within 15 s: {log.strip()}")
            time.sleep(0.1)


class Cluster:
    """`hosts` hosts on one private switch; a context manager. See Note [hosts made of namespaces]."""

    def __init__(self, tmp_path: str | os.PathLike, hosts: int = 2, *, sshd: bool = False):
        ok, reason = sshd_available() if sshd else namespaces_available()
        if not ok:
            raise NamespaceError(reason)
        self.root = Path(tmp_path) / "cluster"
        self.sshd = sshd
        k = random.SystemRandom().randrange(1, 255)
        self.subnet = f"198.18.{k}"  # inside 198.18.0.0/15 only
        self.prefix = f"ms{os.getpid() % 100000}x{k}"
        self.switch = f"{self.prefix}-sw"
        self.local_path = Path("/var/tmp") / f"meshspeed-local-{self.prefix}"
        self.shared_path = self.root / "shared"
        self.hosts = [Host(self, i) for i in range(hosts)]

    # -- set up / tear down -------------------------------------------------------------
    def __enter__(self) -> Cluster:  # noqa: PYI034
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        for d in (self.root / "disks", self.root / "etc", self.shared_path):
            d.mkdir(parents=True, exist_ok=True)
        names = "".join(f"{h.addr} {h.name}\n" for h in self.hosts)
        if self.sshd:
            self._make_keys()
        _sh(_IP, "netns", "add", self.switch)
        _sh(_IP, "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _sh(_IP, "-n", self.switch, "link", "set", "br0", "up")
        for h in self.hosts:
            h.disk.mkdir(parents=True, exist_ok=True)
            h.etc_hosts.write_text(f"127.0.0.1 localhost\n{names}")
            _sh(_IP, "netns", "add", h.netns)
            _sh(_IP, "-n", self.switch, "link", "add", f"v{h.index}", "type", "veth",
                "peer", "name", "eth0", "netns", h.netns)
            _sh(_IP, "-n", self.switch, "link", "set", f"v{h.index}", "master", "br0", "up")
            _sh(_IP, "-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", "eth0")
            _sh(_IP, "-n", h.netns, "link", "set", "eth0", "up")
            _sh(_IP, "-n", h.netns, "link", "set", "lo", "up")
        for h in self.hosts:
            h.boot()

    def _make_keys(self) -> None:
        ssh, dot = self.root / "ssh", self.root / "dotssh"
        ssh.mkdir(parents=True, exist_ok=True)
        dot.mkdir(parents=True, exist_ok=True)
        os.chmod(dot, 0o700)
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(ssh / "host_key"))
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(dot / "id_ed25519"))
        shutil.copy(dot / "id_ed25519.pub", ssh / "authorized_keys")
        (dot / "config").write_text("Host *\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
                                    "  BatchMode yes\n  LogLevel ERROR\n  ConnectTimeout 5\n"
                                    "  ServerAliveInterval 2\n  ServerAliveCountMax 3\n")
        os.chmod(dot / "config", 0o600)

    def close(self) -> None:
        for h in self.hosts:
            h.kill()
        for name in [h.netns for h in self.hosts] + [self.switch]:
            _sh(_IP, "netns", "del", name, check=False)
        with contextlib.suppress(OSError):
            self.local_path.rmdir()  # the mount point, made inside the hosts; empty on the machine

    # -- what tests use -----------------------------------------------------------------
    def cut(self, host: Host) -> None:
        """The host's link down: it is unreachable, and it reaches no one."""
        _sh(_IP, "-n", self.switch, "link", "set", f"v{host.index}", "down")

    def mend(self, host: Host) -> None:
        _sh(_IP, "-n", self.switch, "link", "set", f"v{host.index}", "up")

    def hostfile(self, slots: int = 2, hosts: list[Host] | None = None) -> Path:
        """A DeepSpeed hostfile (`node0 slots=2` per line) of `hosts` (default: all)."""
        path = self.shared_path / f"hostfile-{slots}"
        path.write_text("".join(f"{h.name} slots={slots}\n" for h in (hosts or self.hosts)))
        return path
