"""`launch`: validate the job file (with the command line's overrides: jobs/overrides.py), bring the host's code up to
the local tree where it differs (a deploy, as `deploy` does it: only changed files, atomic, verified), then one
remote action checks the GPUs and the name under a host-wide lock and starts the job (one tmux session per node for
a job over several hosts), or with `queue` puts it in the host's queue for GPUs another job holds; the job is
recorded locally. Nothing is written remotely unless every check passes (a deploy comes after them)."""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from dflashctl.config import HostConfig, resolve_host
from dflashctl.errors import ConfigError, RefusedError
from dflashctl.jobs import control, registry
from dflashctl.jobs.overrides import Overrides, apply
from dflashctl.jobs.registry import JobRecord, Member
from dflashctl.model.jobfile import load_job
from dflashctl.remote import session
from dflashctl.remote.agent_bundle import shown_argv
from dflashctl.remote.connect import open_runner
from dflashctl.remote.sync import DeployReport, build_manifest, deploy, manifest_version, read_remote_state


def new_job_id(name: str, now: datetime | None = None) -> str:
    """name-UTCSTAMP-xxxx: the random tail keeps two launches of one name in the same second apart."""
    return f"{name}-{(now or datetime.now(timezone.utc)):%Y%m%dT%H%M%SZ}-{secrets.token_hex(2)}"


@dataclass
class LaunchReport:
    id: str
    host: str
    run_dir: str
    session: str
    pane_pid: int | None
    release: str
    command: str
    gpus: list[int]
    overrides: list[str]
    dry_run: bool
    files: dict[str, str] = field(default_factory=dict)
    remote_commands: list[str] = field(default_factory=list)
    nodes: list[dict] = field(default_factory=list)  # a multi-node job: host, run_dir, session, pane_pid, gpus each
    slurm_job: str | None = None  # a Slurm host's job id (none for tmux, or a dry run)
    overridden: dict = field(default_factory=dict)  # what --env/--gpus/--name/--host set (secret values as ***)
    deployed: list[dict] = field(default_factory=list)  # the deploy each stale host got first (a dry run: would get)
    queued: dict | None = None  # `--queue` on a busy host: ticket, position, waiting_for, since

    def to_dict(self) -> dict:
        return asdict(self)


def launch(
    job_path: Path,
    root: Path,
    *,
    sync: bool = True,
    force: bool = False,
    dry_run: bool = False,
    accept_new: bool = False,
    progress=None,
    overrides: Overrides | None = None,
    queue: bool = False,
) -> LaunchReport:
    """Validate (with the overrides), sync a stale host's code (unless `sync` is off: then a stale host is refused),
    then one remote action checks the GPUs and the name under a host-wide lock and starts the job, or queues it
    (`queue`). Nothing is written remotely unless every check passes."""
    socket = session.tmux_socket()
    registry.all_jobs()  # records that cannot be read refuse the launch before anything starts remotely
    job, trainer_cfg = load_job(job_path, root)
    job, overridden = apply(job, overrides or Overrides(), root)
    hosts = [resolve_host(n.host, root) for n in job.nodes]
    _check_scheduler(job, hosts, job_path, queue, force)
    job_id = new_job_id(job.name)
    local_version = manifest_version(build_manifest(root))
    if job.multi_node:
        return launch_nodes(
            job_path,
            root,
            job,
            trainer_cfg,
            hosts,
            job_id,
            local_version,
            socket,
            sync=sync,
            force=force,
            dry_run=dry_run,
            accept_new=accept_new,
            progress=progress,
            overridden=overridden,
        )
    host = hosts[0]
    with open_runner(host, accept_new) as runner:
        abs_wd, current, _ = read_remote_state(runner, host.workdir)
        stale = current != local_version
        if stale and not sync:
            raise RefusedError(
                f"{host.name}: deployed code is {current or 'nothing'}, the local tree is "
                f"{local_version}; --no-sync runs the deployed release only: run `dflashctl deploy "
                f"{host.name}`, or launch without --no-sync"
            )
        cluster = host.slurm
        command = job.command or session.trainer_command(job, host.python, slurm=cluster is not None)
        report = LaunchReport(
            id=job_id,
            host=host.name,
            run_dir=f"{abs_wd}/runs/{job_id}",
            session=session.session_name(job_id),
            pane_pid=None,
            release=local_version,
            command=command,
            gpus=job.gpu_indices,
            overrides=[],
            dry_run=dry_run,
            overridden=overridden,
        )
        req = {
            "action": "launch",
            "workdir": abs_wd,
            "job_id": job_id,
            "name": job.name,
            "session": report.session,
            "project": session.project_key(root),
            "queue": queue,
            "gpus": job.gpu_indices,
            "force": force,
            "release": local_version,
            "python": host.python,
            "tmux_socket": socket,
            "needs": {"torch": job.trainer is not None, "cuda": bool(job.gpu_indices)},
            **({"scheduler": "slurm"} if cluster else {}),
        }

        def files_for(release: str, redact: bool = False) -> dict[str, str]:
            return session.run_files(
                job,
                job_id,
                host.python,
                trainer_cfg,
                release,
                redact=redact,
                cluster=cluster,
                project=None if redact else session.project_key(root),
                run_dir=report.run_dir,
                overridden=overridden,
            )

        if dry_run or stale:  # every launch check before a dry-run's "would launch" or a stale host's deploy
            # a Slurm dry run sends the batch script along: `sbatch --test-only` judges it, submitting nothing
            sbatch = {k: v for k, v in files_for(local_version).items() if k == "sbatch.sh"}
            check = json.dumps(sbatch).encode() if dry_run else b""
            pre = session.call_agent(runner, {**req, "check_only": True, "skip_release": stale}, payload=check)
            _raise_refusal(pre, host, job_path)
            report.overrides = list(pre.get("overrides", []))
            if pre.get("would_queue"):
                report.queued = {"ticket": None, "position": None, "waiting_for": pre["would_queue"], "since": None}
        if dry_run:
            if stale:
                report.deployed = [_deployed(deploy(runner, root, host.workdir, dry_run=True))]
            report.files = files_for(local_version, redact=True)
            report.remote_commands = [runner.describe(shown_argv(host.python, "probe", json.dumps(req)))]
            if cluster:
                report.remote_commands.append(f"sbatch {report.run_dir}/sbatch.sh")
            return report
        if stale:  # the tree may have changed since it was hashed: the release is the one this deploy made current
            sent = deploy(runner, root, host.workdir, progress=progress)
            report.deployed = [_deployed(sent)]
            report.release = req["release"] = sent.version
        ans = session.call_agent(runner, req, payload=json.dumps(files_for(report.release)).encode())
    _raise_refusal(ans, host, job_path)
    report.run_dir, report.pane_pid, report.overrides = ans["run_dir"], ans["pane_pid"], ans.get("overrides", [])
    report.remote_commands = [
        runner.describe(shown_argv(host.python, "probe", json.dumps(req))),
        *([ans["started"]] if ans.get("started") else []),
        *([f"sbatch {report.run_dir}/sbatch.sh"] if cluster else []),
    ]
    report.slurm_job = ans.get("slurm_job")
    report.queued = ans.get("queued") if isinstance(ans.get("queued"), dict) else None
    waits = (report.queued or {}).get("waiting_for") or ["its GPUs"]
    registry.record(
        _job_record(
            job,
            job_id,
            root,
            job_path,
            host,
            report,
            command,
            socket,
            trainer_cfg,
            release=report.release,
            run_dir=report.run_dir,
            session=report.session,
            pane_pid=report.pane_pid,
            gpus=job.gpu_indices,
            slurm_job=report.slurm_job,
            **(
                {
                    "state": "QUEUED",
                    "reason": f"place {report.queued.get('position')} in the host's queue, waiting for {waits[0]}",
                }
                if report.queued
                else {}
            ),
        )
    )
    return report


def _job_record(job, job_id: str, root, job_path, host, report, command, socket, trainer_cfg, **where) -> JobRecord:
    """The laptop's record of a job just started (one host or several): what every launch records, and `where` it
    runs (release, run dir, session, pane, GPUs; a Slurm id or the nodes)."""
    return JobRecord(
        id=job_id,
        name=job.name,
        project=str(root),
        job_file=str(job_path.resolve()),
        host_name=host.name,
        host=host,
        command=command,
        launched_at=time.time(),
        kill_grace_s=job.kill_grace_s,
        is_trainer=job.trainer is not None,
        overrides=report.overrides,
        tmux_socket=socket,
        watch=job.watch.model_copy(update={"startup_budget_s": job.startup_budget(trainer_cfg)}),
        steps=(trainer_cfg or {}).get("steps"),
        **where,
    )


def _deployed(rep: DeployReport) -> dict:
    """What a launch's deploy sent (or would send), as `deploy --json` says it."""
    return rep.to_dict()


def _check_scheduler(job, hosts: list[HostConfig], job_path: Path, queue: bool = False, force: bool = False) -> None:
    """A job's `slurm:` needs a Slurm host, and a Slurm host runs all of a job's nodes itself (`slurm.nodes`); a
    Slurm host queues by itself, and a job over several hosts cannot wait on each (yet); `setup:` is run by the tmux
    wrapper, which a Slurm host does not use."""
    if queue and force:
        raise ConfigError("--queue", None, "--force launches on held GPUs at once; --queue waits for them: not both")
    if queue and hosts[0].slurm is not None:
        raise ConfigError(
            "--queue",
            None,
            f"host {hosts[0].name} is a Slurm cluster: its own queue holds the job (PENDING) until the GPUs free",
        )
    if queue and job.multi_node:
        raise ConfigError(
            "--queue", None, "a job over several hosts cannot wait in their queues: launch it when its GPUs are free"
        )
    if job.setup is not None and hosts[0].slurm is not None:
        raise ConfigError(
            str(job_path),
            "setup",
            f"host {hosts[0].name} is a Slurm cluster, where `setup:` is not run: put it at the head of `command:`",
        )
    if job.multi_node and any(h.slurm is not None for h in hosts):
        names = ", ".join(h.name for h in hosts if h.slurm is not None)
        raise ConfigError(
            str(job_path),
            "hosts",
            f"{names} is a Slurm cluster: name it alone as `host:` and ask for "
            "several nodes with `slurm: {nodes: N}`",
        )
    if job.slurm is not None and hosts[0].slurm is None:
        raise ConfigError(
            str(job_path), "slurm", f"host {hosts[0].name} is not a Slurm host (its entry has no `slurm:`)"
        )


def rdzv_port_for(name: str) -> int:
    """A port of the job name's own (two live jobs of one name on one head are refused), known before the launch so
    that `doctor JOB.yaml` checks the port the job will use."""
    return 29500 + int(hashlib.sha256(name.encode()).hexdigest(), 16) % 400


def rendezvous_address(host: HostConfig) -> str:
    """The head's address as the other nodes reach it: `rdzv_host`, else the ssh HostName, else loopback."""
    if host.rdzv_host:
        return host.rdzv_host
    if host.is_local:
        return "127.0.0.1"
    from dflashctl.remote.ssh import resolve_ssh_target

    return resolve_ssh_target(host).hostname


def launch_nodes(
    job_path: Path,
    root: Path,
    job,
    trainer_cfg: dict | None,
    hosts: list[HostConfig],
    job_id: str,
    version: str,
    socket: str,
    *,
    sync: bool,
    force: bool,
    dry_run: bool,
    accept_new: bool,
    progress,
    overridden: dict,
) -> LaunchReport:
    """One job over several hosts: the same release on every node (each stale node synced, after every node's
    launch checks passed), then one tmux session per node (head first); a node that refuses at the start stops the
    nodes already started."""
    from dflashctl.remote.session import NodePlace

    port = job.rdzv_port or rdzv_port_for(job.name)
    head = rendezvous_address(hosts[0])
    places = [
        NodePlace(i, len(hosts), head, port, tuple(job.node_gpus(n)), tuple(n.env.items()))
        for i, n in enumerate(job.nodes)
    ]
    runners = [open_runner(h, accept_new) for h in hosts]
    try:
        workdirs, stale, said = [], [], []
        for host, runner in zip(hosts, runners, strict=True):
            abs_wd, current, _ = read_remote_state(runner, host.workdir)
            workdirs.append(abs_wd)
            stale.append(current != version)
            said += [f"{host.name}: deployed code is {current or 'nothing'}"] if current != version else []
        if said and not sync:
            raise RefusedError(
                f"{'; '.join(said)}; the local tree is {version}: --no-sync runs the deployed release "
                "only: run `dflashctl deploy` on each host, or launch without --no-sync"
            )
        sess = session.session_name(job_id)
        # node i > 0 gets a session name of its own: two nodes may share one machine (and its tmux server)
        sessions = [session.node_session(job_id, pl) for pl in places]
        command = job.command or session.trainer_command(job, hosts[0].python, places[0])
        report = LaunchReport(
            id=job_id,
            host=",".join(h.name for h in hosts),
            run_dir=f"{workdirs[0]}/runs/{job_id}",
            session=sess,
            pane_pid=None,
            release=version,
            command=command,
            gpus=list(places[0].gpus),
            overrides=[],
            dry_run=dry_run,
            overridden=overridden,
        )
        report.nodes = [
            {
                "host": h.name,
                "run_dir": f"{wd}/runs/{job_id}",
                "session": sessions[pl.rank],
                "pane_pid": None,
                "gpus": list(pl.gpus),
                "node_rank": pl.rank,
            }
            for h, wd, pl in zip(hosts, workdirs, places, strict=True)
        ]
        # the head's supervisor probes and restarts the other nodes: how it reaches each, in its supervise.json
        members = (
            [
                session.member_spec(job_id, pl, h, n, hosts[0], f"{wd}/runs/{job_id}")
                for h, wd, pl, n in zip(hosts, workdirs, places, job.nodes, strict=True)
            ][1:]
            if job.watch.supervise
            else None
        )
        reqs = [
            {
                "action": "launch",
                "workdir": wd,
                "job_id": job_id,
                "name": job.name,
                "session": sessions[pl.rank],
                "gpus": list(pl.gpus),
                "force": force,
                "release": version,
                "python": h.python,
                "tmux_socket": socket,
                "needs": {"torch": job.trainer is not None, "cuda": bool(pl.gpus)},
            }
            for h, wd, pl in zip(hosts, workdirs, places, strict=True)
        ]
        for h, r, req, old in zip(hosts, runners, reqs, stale, strict=True):  # every node must pass before any starts
            ans = session.call_agent(r, {**req, "check_only": True, "skip_release": old})
            _raise_refusal(ans, h, job_path, can_queue=False)
        for h, r, old in zip(hosts, runners, stale, strict=True):  # every node runs the same release: the local tree
            if old:
                rep = deploy(r, root, h.workdir, dry_run=dry_run, progress=None if dry_run else progress)
                report.deployed.append(_deployed(rep))
                if not dry_run and rep.version != version:
                    raise RefusedError(
                        f"{h.name}: the local tree changed during the launch (now {rep.version}, was "
                        f"{version}): launch again"
                    )
        files = [
            session.run_files(
                job,
                job_id,
                h.python,
                trainer_cfg,
                version,
                redact=dry_run,
                node=pl,
                run_dir=f"{wd}/runs/{job_id}",
                members=members if pl.rank == 0 else None,
                overridden=overridden,
            )
            for h, wd, pl in zip(hosts, workdirs, places, strict=True)
        ]
        if dry_run:
            report.files = files[0]
            report.remote_commands = [
                r.describe(shown_argv(h.python, "probe", json.dumps(req)))
                for h, r, req in zip(hosts, runners, reqs, strict=True)
            ]
            return report
        members: list[Member] = []
        try:
            for i, (h, r, req, f) in enumerate(zip(hosts, runners, reqs, files, strict=True)):
                ans = session.call_agent(r, req, payload=json.dumps(f).encode())
                _raise_refusal(ans, h, job_path, can_queue=False)
                members.append(
                    Member(
                        node=i,
                        host_name=h.name,
                        host=h,
                        run_dir=ans["run_dir"],
                        session=sessions[i],
                        pane_pid=ans["pane_pid"],
                        gpus=list(places[i].gpus),
                    )
                )
                report.overrides += [f"{h.name}: {o}" for o in ans.get("overrides", [])]
                report.remote_commands += [
                    r.describe(shown_argv(h.python, "probe", json.dumps(req))),
                    *([ans["started"]] if ans.get("started") else []),
                ]
        except Exception:
            for m, r in zip(members, runners, strict=False):  # never leave half a job running
                rec = JobRecord(
                    id=job_id,
                    name=job.name,
                    project=str(root),
                    job_file=str(job_path),
                    host_name=m.host_name,
                    host=m.host,
                    release=version,
                    command=command,
                    run_dir=m.run_dir,
                    session=m.session,
                    launched_at=time.time(),
                    tmux_socket=socket,
                    kill_grace_s=5.0,
                )
                control.stop(r, rec, 5.0)
            raise
    finally:
        for r in runners:
            r.close()
    report.run_dir, report.pane_pid = members[0].run_dir, members[0].pane_pid
    for node, m in zip(report.nodes, members, strict=True):
        node.update(run_dir=m.run_dir, pane_pid=m.pane_pid)
    registry.record(
        _job_record(
            job,
            job_id,
            root,
            job_path,
            hosts[0],
            report,
            command,
            socket,
            trainer_cfg,
            release=version,
            run_dir=members[0].run_dir,
            session=sess,
            pane_pid=members[0].pane_pid,
            gpus=members[0].gpus,
            members=members,
        )
    )
    return report


def _raise_refusal(ans: dict, host: HostConfig, job_path: Path, can_queue: bool = True) -> None:
    """The agent's refusal as one line: a config problem names the job file and key; GPUs held say that --queue
    waits for them (where it can: one host)."""
    if ans.get("refused"):
        if ans.get("config"):
            raise ConfigError(str(job_path), ans.get("key"), f"{'; '.join(ans['refused'])} (host {host.name})")
        said = "; ".join(ans["refused"])
        if ans.get("queueable") and can_queue:
            said += " (--queue waits for them, --force launches anyway)"
        elif "--force" not in ans["refused"][-1]:
            said += " (use --force to launch anyway)"
        raise RefusedError(f"{host.name}: {said}")
