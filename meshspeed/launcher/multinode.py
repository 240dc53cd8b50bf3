"""`meshspeed run`'s arguments -> the `RemoteJob` that starts every host. Pure (reads files).

Under ssh/pdsh each host runs `meshspeed run` with the user's torchrun options and the
script; meshspeed sets the rendezvous itself (c10d at --master_addr:--master_port, one
--rdzv-id for the job), so options that would set another are refused. Under
openmpi/slurm there is no torchrun: each rank runs the script directly.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from collections.abc import Mapping

from meshspeed.launcher import elastic, exports
from meshspeed.launcher.ds_launcher import LaunchError, LaunchPlan
from meshspeed.launcher.remote_plan import RemoteJob

# torchrun options meshspeed sets for every host of a remote launch
_RENDEZVOUS = ("--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint", "--rdzv_endpoint", "--standalone",
               "--node-rank", "--node_rank", "--nproc-per-node", "--nproc_per_node")
# torchrun options that still mean something when mpirun/srun start the ranks
_RANK_OPTIONS = ("-m", "--module")


def _given(tokens: list[str], names: tuple[str, ...]) -> str | None:
    return next((t.split("=", 1)[0] for t in tokens if t.split("=", 1)[0] in names), None)


def remote_job(plan: LaunchPlan, ns: argparse.Namespace, rest: list[str], target: list[str],
               parsed: argparse.Namespace, environ: Mapping[str, str]) -> RemoteJob:
    """The job for `plan.hosts` (see the module docstring)."""
    spec, rest = elastic.take_option(rest, ("--nnodes",))
    if spec is None and (ns.elastic_training or ns.min_elastic_nodes is not None):
        spec = f"{ns.min_elastic_nodes or 1}:{len(plan.hosts)}"
    span = elastic.nnodes_range(spec)
    if span is not None and span[1] > len(plan.hosts):
        raise LaunchError(f"--nnodes {spec}: there are {len(plan.hosts)} hosts to start")
    rdzv_id, rest = elastic.take_option(rest, ("--rdzv-id", "--rdzv_id"))
    bad = _given(rest, _RENDEZVOUS)
    if bad:
        raise LaunchError(f"{bad}: meshspeed run sets the rendezvous of a launch on several hosts itself "
                          "(c10d at --master_addr:--master_port); leave it out")
    cwd = os.getcwd()
    try:
        sent = exports.exports(environ, cwd)
    except exports.EnvFileError as err:
        raise LaunchError(str(err)) from None
    job = RemoteJob(hosts=plan.hosts, master_addr=plan.master_addr, master_port=plan.master_port,
                    job_id=rdzv_id or f"meshspeed-{uuid.uuid4().hex[:12]}", python=sys.executable, cwd=cwd,
                    target=target, launcher=plan.launcher, nnodes=spec, ssh_port=ns.ssh_port, exports=sent,
                    host_env=plan.host_env)
    if plan.launcher in ("ssh", "pdsh"):
        job.torchrun_options = rest
        job.run_options = (["--deepspeed-compat"] if ns.deepspeed_compat else []) + \
            (["--no_local_rank"] if ns.no_local_rank else []) + \
            (["--bind_cores_to_rank"] if ns.bind_cores_to_rank else [])
        return job
    return _rank_job(job, ns, rest, parsed, span)


def _rank_job(job: RemoteJob, ns, rest: list[str], parsed, span) -> RemoteJob:
    """mpirun/srun start the ranks themselves: the script (or module) runs directly."""
    if span is not None and span[0] != span[1]:
        raise LaunchError(f"--nnodes {job.nnodes}: elastic jobs need torchrun's agents; "
                          f"use --launcher ssh or pdsh, not {job.launcher}")
    left = [t for t in rest if t not in _RANK_OPTIONS]
    if left:
        raise LaunchError(f"{left[0]}: a torchrun option, and under --launcher {job.launcher} no torchrun "
                          "runs; leave it out")
    if job.host_env:
        raise LaunchError(f"--include/--exclude with slots: --launcher {job.launcher} cannot give each host "
                          "its own CUDA_VISIBLE_DEVICES; name whole hosts, or use --launcher ssh")
    if ns.deepspeed_compat:
        # DeepSpeed's MPI and Slurm runners pass no --local_rank either
        job.target = ["-m", "meshspeed.compat.child", *(["--module"] if parsed.module else []),
                      "--no-local-rank", *job.target]
    elif parsed.module:
        job.target = ["-m", *job.target]
    return job
