"""`meshspeed gather-checkpoint`: one complete checkpoint from the hosts' node-local disks.

    meshspeed gather-checkpoint --hostfile hostfile /ckpt [--tag global_step20] [--to DIR]

A checkpoint saved with `checkpoint.use_node_local_storage` lies under the same path on
every host, each host holding its own ranks' files (Note [checkpoints on node-local disks]
in hosts.py). Loading reads missing files over the network from the hosts of the job; a
job without some of those hosts (fewer hosts, other hosts) needs the checkpoint gathered
first. This command copies the tag from every host of the hostfile over ssh
(`ssh HOST tar -C /ckpt -cf - TAG | tar -x`) into DIR (default: /ckpt on this host), checks
every file against meta.json, and writes DIR/latest (when no tag was given): the normal
loader then reads it at any layout.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile

from meshspeed.checkpoint.atomic import publish_dir, remove_tree, write_text
from meshspeed.checkpoint.errors import CheckpointError
from meshspeed.checkpoint.metadata import read_meta
from meshspeed.checkpoint.paths import LATEST, check_tag, read_latest
from meshspeed.checkpoint.reshard import verify_files

TIMEOUT_S = float(os.environ.get("MESHSPEED_GATHER_TIMEOUT", "3600"))


def read_hosts(path: str) -> list[str]:
    """Host names of a DeepSpeed hostfile (`name slots=N` lines, `#` comments)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as err:
        raise CheckpointError(f"cannot read the hostfile {path}: {err.strerror}") from None
    hosts = [line.split("#")[0].split()[0] for line in lines if line.split("#")[0].strip()]
    if not hosts:
        raise CheckpointError(f"the hostfile {path} names no host; write one `HOST slots=N` per line")
    return list(dict.fromkeys(hosts))


def _ssh(args: argparse.Namespace) -> list[str]:
    cmd = shlex.split(args.ssh)
    return cmd + (["-p", str(args.ssh_port)] if args.ssh_port else [])


def _remote_latest(ssh: list[str], host: str, src: str) -> str:
    r = subprocess.run([*ssh, host, f"cat {shlex.quote(os.path.join(src, LATEST))}"],
                       capture_output=True, text=True, timeout=120, check=False)
    if r.returncode != 0 or not r.stdout.strip():
        raise CheckpointError(f"cannot read {os.path.join(src, LATEST)} on {host} "
                              f"({r.stderr.strip() or 'empty'}); pass --tag")
    return check_tag(r.stdout.strip())


def copy_from(ssh: list[str], host: str, src: str, tag: str, stage: str) -> str | None:
    """`ssh host tar -C src -cf - tag | tar -C stage -xf -`; None, or why it failed."""
    remote = f"tar -C {shlex.quote(src)} -cf - {shlex.quote(tag)}"
    with tempfile.TemporaryFile() as err_a, tempfile.TemporaryFile() as err_b:
        sender = subprocess.Popen([*ssh, host, remote], stdout=subprocess.PIPE, stderr=err_a)
        receiver = subprocess.Popen(["tar", "-C", stage, "-xf", "-"], stdin=sender.stdout, stderr=err_b)
        sender.stdout.close()  # the receiver holds the pipe now
        try:
            rc_b = receiver.wait(timeout=TIMEOUT_S)
            rc_a = sender.wait(timeout=60)
        except subprocess.TimeoutExpired:
            sender.kill()
            receiver.kill()
            sender.wait()
            receiver.wait()
            return f"no complete copy within {TIMEOUT_S:.0f} s"
        if rc_a or rc_b:
            err_a.seek(0)
            err_b.seek(0)
            text = (err_a.read() + err_b.read()).decode(errors="replace")
            return " ".join(text.split()) or f"exit status {rc_a or rc_b}"
    return None


def gather(hosts: list[str], src: str, tag: str | None, to: str, ssh: list[str],
           say=print) -> str:
    """Copy `tag` (default: the first host's `latest`) of `src` from every host into `to`;
    returns the complete checkpoint directory."""
    src, to = os.path.abspath(src), os.path.abspath(to)
    from_latest = tag is None
    tag = _remote_latest(ssh, hosts[0], src) if from_latest else check_tag(tag)
    os.makedirs(to, exist_ok=True)
    stage = tempfile.mkdtemp(prefix=f"{tag}.tmp-gather-", dir=to)  # ".tmp-": loaders ignore it
    try:
        failed = {}
        for host in hosts:
            why = copy_from(ssh, host, src, tag, stage)
            if why:
                failed[host] = why
            say(f"{host}: {'no copy (' + why + ')' if why else 'copied'} {os.path.join(src, tag)}")
        got = os.path.join(stage, tag)
        if not os.path.isdir(got):
            raise CheckpointError(f"no host of {', '.join(hosts)} holds {os.path.join(src, tag)} "
                                  f"({'; '.join(f'{h}: {w}' for h, w in failed.items())})")
        final = os.path.join(to, tag)
        if os.path.isdir(final):  # e.g. this host's own copy: add the files it lacks
            _merge(got, final)
            _check(final, tag, hosts)
        else:  # appears only when complete
            _check(got, tag, hosts)
            publish_dir(got, final)
    finally:
        remove_tree(stage)
    if from_latest and read_latest(to) != tag:
        write_text(os.path.join(to, LATEST), tag)
    return final


def _merge(got: str, final: str) -> None:
    """Move into `final` each gathered file it lacks."""
    for name in sorted(os.listdir(got)):
        if not os.path.exists(os.path.join(final, name)):
            os.replace(os.path.join(got, name), os.path.join(final, name))


def _check(path: str, tag: str, hosts: list[str]) -> None:
    meta = read_meta(path)
    missing = [n for n in sorted(meta["files"]) if not os.path.isfile(os.path.join(path, n))]
    if missing:
        saved_on = ", ".join(dict.fromkeys((meta.get("storage") or {}).get("hosts", [])))
        raise CheckpointError(f"the hosts' copies of {tag} do not make a complete checkpoint: "
                              f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} on none "
                              f"of {', '.join(hosts)}" + (f" (it was saved on {saved_on}): list "
                              "those hosts in the hostfile" if saved_on else ""))
    try:
        verify_files(path, meta)
    except CheckpointError as err:
        raise CheckpointError(f"the hosts' copies of {tag} do not make a complete checkpoint: "
                              f"{err}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="the save_dir, the same path on every host")
    parser.add_argument("--hostfile", required=True, help="DeepSpeed hostfile naming every host")
    parser.add_argument("--tag", default=None, help="the tag to gather (default: `latest` of the first host)")
    parser.add_argument("--to", default=None, help="where to put the complete checkpoint "
                        "(default: the same path on this host)")
    parser.add_argument("--ssh", default=os.environ.get("MESHSPEED_SSH", "ssh"),
                        help="the ssh command (default: ssh, or $MESHSPEED_SSH)")
    parser.add_argument("--ssh-port", type=int, default=None, help="ssh port of the hosts")


def main(args: argparse.Namespace) -> int:
    try:
        final = gather(read_hosts(args.hostfile), args.checkpoint, args.tag,
                       args.to or args.checkpoint, _ssh(args))
    except CheckpointError as err:
        print(f"meshspeed gather-checkpoint: {err}", file=sys.stderr)
        return 1
    print(f"gathered {final}: a complete checkpoint, loadable at any layout")
    return 0
