"""`doctor HOST|JOB.yaml`: the checks of one host, or of every node of a job file and then the job's own."""

from __future__ import annotations

from pathlib import Path

from dflashctl.config import resolve_host
from dflashctl.errors import UnreachableError
from dflashctl.jobs.launch import rdzv_port_for, rendezvous_address
from dflashctl.model.jobfile import load_job
from dflashctl.remote.connect import open_runner


def doctor_reports(spec: str, root: Path, accept_new: bool = False) -> list:
    """`doctor HOST|JOB.yaml`: a host's own checks (a Slurm host's: doctor_slurm), or, for a job file over several
    hosts, every node's and then the job's (rendezvous port, the same torch and NCCL)."""
    from dflashctl.remote.doctor import run_doctor, run_nodes_doctor

    if spec.endswith((".yaml", ".yml")) and Path(spec).is_file():
        job, _ = load_job(Path(spec), root)
        hosts = [resolve_host(n.host, root) for n in job.nodes]
        if len(hosts) > 1:
            return run_nodes_doctor(
                hosts,
                lambda h: open_runner(h, accept_new),
                rendezvous_address(hosts[0]),
                job.rdzv_port or rdzv_port_for(job.name),
            )
        target = hosts[0]
    else:
        target = resolve_host(spec, root)
    try:
        with open_runner(target, accept_new) as runner:  # connecting is lazy: the first command may not reach it
            if target.slurm is not None:
                from dflashctl.remote.doctor_slurm import run_slurm_doctor

                return [run_slurm_doctor(runner)]
            return [run_doctor(runner)]
    except UnreachableError as e:  # said in the table (and the JSON) like every other check
        from dflashctl.remote.doctor import Check, DoctorReport

        return [DoctorReport(target.name, [Check("reachable", "fail", str(e), required=True)])]
