"""launch, kill, status and logs: each validates first, then talks to the remote through one runner.

A job is found again through the local registry: its host settings, run dir, tmux session and job id are recorded at
launch, so later commands need nothing but the id (or a prefix of it, or nothing for the newest).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from dflashctl.config import HostConfig, resolve_host
from dflashctl.errors import (
    ConfigError,
    DflashError,
    NoSuchJobError,
    NothingToDoError,
    RefusedError,
    RemoteCommandError,
    UnreachableError,
)
from dflashctl.jobs import control, notify, registry
from dflashctl.jobs.control import KillReport
from dflashctl.jobs.poller import make_watcher
from dflashctl.jobs.registry import JobRecord, Member
from dflashctl.jobs.secrets import redactor
from dflashctl.judge.facts import DONE_FOR_GOOD
from dflashctl.judge.report import HERE, Report
from dflashctl.model.jobfile import load_job
from dflashctl.remote import session
from dflashctl.remote.agent_bundle import shown_argv
from dflashctl.remote.connect import open_runner
from dflashctl.remote.sync import build_manifest, deploy, manifest_version, read_remote_state


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

    def to_dict(self) -> dict:
        return asdict(self)


def launch(
    job_path: Path, root: Path, *, deploy_first: bool = False, force: bool = False, dry_run: bool = False,
    accept_new: bool = False, progress=None,
) -> LaunchReport:  # fmt: skip
    """Validate, check the deployed release, then one remote action checks the GPUs and the name under a host-wide
    lock and starts the job. Nothing is written remotely unless every check passes."""
    socket = session.tmux_socket()
    registry.all_jobs()  # records that cannot be read refuse the launch before anything starts remotely
    job, trainer_cfg = load_job(job_path, root)
    hosts = [resolve_host(n.host, root) for n in job.nodes]
    _check_scheduler(job, hosts, job_path)
    job_id = new_job_id(job.name)
    local_version = manifest_version(build_manifest(root))
    if job.multi_node:
        return launch_nodes(job_path, root, job, trainer_cfg, hosts, job_id, local_version, socket,
                            deploy_first=deploy_first, force=force, dry_run=dry_run, accept_new=accept_new,
                            progress=progress)  # fmt: skip
    host = hosts[0]
    with open_runner(host, accept_new) as runner:
        abs_wd, current, _ = read_remote_state(runner, host.workdir)
        if current != local_version and not deploy_first:
            raise RefusedError(
                f"{host.name}: deployed code is {current or 'nothing'}, the local tree is {local_version}; "
                f"run `dflashctl deploy {host.name}` or launch with --deploy"
            )
        cluster = host.slurm
        command = job.command or session.trainer_command(job, host.python, slurm=cluster is not None)
        report = LaunchReport(
            id=job_id, host=host.name, run_dir=f"{abs_wd}/runs/{job_id}", session=session.session_name(job_id),
            pane_pid=None, release=local_version, command=command, gpus=job.gpu_indices, overrides=[],
            dry_run=dry_run,
        )  # fmt: skip
        req = {"action": "launch", "workdir": abs_wd, "job_id": job_id, "name": job.name, "session": report.session,
               "project": session.project_key(root),
               "gpus": job.gpu_indices, "force": force, "release": local_version, "python": host.python,
               "tmux_socket": socket, "needs": {"torch": job.trainer is not None, "cuda": bool(job.gpu_indices)},
               **({"scheduler": "slurm"} if cluster else {})}  # fmt: skip
        files = session.run_files(job, job_id, host.python, trainer_cfg, local_version, cluster=cluster,
                                  project=session.project_key(root), run_dir=report.run_dir)  # fmt: skip
        if dry_run or deploy_first:  # every launch check before a dry-run's "would launch" or a --deploy's upload
            # a Slurm dry run sends the batch script along: `sbatch --test-only` judges it, submitting nothing
            check = json.dumps({k: v for k, v in files.items() if k == "sbatch.sh"}).encode() if dry_run else b""
            pre = session.call_agent(runner, {**req, "check_only": True, "skip_release": deploy_first}, payload=check)
            _raise_refusal(pre, host, job_path)
            report.overrides = list(pre.get("overrides", []))
        if dry_run:
            report.files = session.run_files(job, job_id, host.python, trainer_cfg, local_version, redact=True,
                                             cluster=cluster, run_dir=report.run_dir)  # fmt: skip
            report.remote_commands = [runner.describe(shown_argv(host.python, "probe", json.dumps(req)))]
            if cluster:
                report.remote_commands.append(f"sbatch {report.run_dir}/sbatch.sh")
            return report
        if deploy_first:
            deploy(runner, root, host.workdir, progress=progress)
        ans = session.call_agent(runner, req, payload=json.dumps(files).encode())
    if ans.get("refused"):
        if ans.get("config"):
            raise ConfigError(str(job_path), ans.get("key"), f"{'; '.join(ans['refused'])} (host {host.name})")
        raise RefusedError(f"{host.name}: {'; '.join(ans['refused'])}" + ("" if "--force" in ans["refused"][-1] else
                                                                          " (use --force to launch anyway)"))
    report.run_dir, report.pane_pid, report.overrides = ans["run_dir"], ans["pane_pid"], ans.get("overrides", [])
    report.remote_commands = [runner.describe(shown_argv(host.python, "probe", json.dumps(req))),
                              *([ans["started"]] if ans.get("started") else []),
                              *([f"sbatch {report.run_dir}/sbatch.sh"] if cluster else [])]  # fmt: skip
    report.slurm_job = ans.get("slurm_job")
    registry.record(JobRecord(
        id=job_id, name=job.name, project=str(root), job_file=str(job_path.resolve()), host_name=host.name,
        host=host, release=local_version, command=command, run_dir=report.run_dir, session=report.session,
        pane_pid=report.pane_pid, gpus=job.gpu_indices, launched_at=time.time(), kill_grace_s=job.kill_grace_s,
        is_trainer=job.trainer is not None, overrides=report.overrides, tmux_socket=socket,
        watch=job.watch.model_copy(update={"startup_budget_s": job.startup_budget(trainer_cfg)}),
        steps=(trainer_cfg or {}).get("steps"), slurm_job=report.slurm_job,
    ))  # fmt: skip
    return report


def _check_scheduler(job, hosts: list[HostConfig], job_path: Path) -> None:
    """A job's `slurm:` needs a Slurm host, and a Slurm host runs all of a job's nodes itself (`slurm.nodes`)."""
    if job.multi_node and any(h.slurm is not None for h in hosts):
        names = ", ".join(h.name for h in hosts if h.slurm is not None)
        raise ConfigError(str(job_path), "hosts", f"{names} is a Slurm cluster: name it alone as `host:` and ask for "
                          "several nodes with `slurm: {nodes: N}`")  # fmt: skip
    if job.slurm is not None and hosts[0].slurm is None:
        raise ConfigError(str(job_path), "slurm", f"host {hosts[0].name} is not a Slurm host (its entry has no "
                          "`slurm:`)")  # fmt: skip


def doctor_reports(spec: str, root: Path, accept_new: bool = False) -> list:
    """`doctor HOST|JOB.yaml`: a host's own checks (a Slurm host's: doctor_slurm), or, for a job file over several
    hosts, every node's and then the job's (rendezvous port, the same torch and NCCL)."""
    from dflashctl.remote.doctor import run_doctor, run_nodes_doctor

    if spec.endswith((".yaml", ".yml")) and Path(spec).is_file():
        job, _ = load_job(Path(spec), root)
        hosts = [resolve_host(n.host, root) for n in job.nodes]
        if len(hosts) > 1:
            return run_nodes_doctor(hosts, lambda h: open_runner(h, accept_new), rendezvous_address(hosts[0]),
                                    job.rdzv_port or rdzv_port_for(job.name))  # fmt: skip
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


def check_number(option: str, value: float | None, positive: bool = False) -> None:
    """A number given on the command line is finite and at least 0 (above 0 with `positive`): `nan` compares false
    with everything, so an unchecked one silently turns every limit off."""
    if value is None:
        return
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ConfigError(option, None, f"{value:g}: expected a finite number {'above' if positive else '0 or'} "
                          f"{'0' if positive else 'more'}")  # fmt: skip


def gc(spec: str, root: Path, older_than_days: float, dry_run: bool, accept_new: bool = False,
       all_projects: bool = False, only: list[str] | None = None) -> dict:  # fmt: skip
    """Remove HOST's run dirs of this project's jobs (every project's with `all_projects`) that ended over
    `older_than_days` ago (never a live job's, never one whose supervisor runs, never one holding a mount): one remote
    action under the workdir's launch lock. `dry_run` lists them and changes nothing; `only` limits the removal to the
    run dirs a user was shown and confirmed. The result's `removed_ids`
    are the job ids whose run dirs are gone, for the local registry to mark."""
    check_number("--older-than", older_than_days)
    host = resolve_host(spec, root)
    with open_runner(host, accept_new) as runner:
        abs_wd, _, _ = read_remote_state(runner, host.workdir)
        ans = session.call_agent(runner, {"action": "gc", "workdir": abs_wd, "older_than_s": older_than_days * 86400,
                                          "dry_run": dry_run, "gpus": False,
                                          "project": None if all_projects else session.project_key(root),
                                          **({"only": list(only)} if only is not None else {}),
                                          "tmux_socket": session.tmux_socket()}, timeout=600)  # fmt: skip
    if ans.get("refused"):
        raise ConfigError("gc", None, f"the agent on {host.name} refused: {ans['refused']}")
    ids = [] if ans.get("dry_run") else [r["id"] for r in ans.get("removed", [])]
    if ids:  # their records say REMOVED, by whom and when: never LOST later
        registry.mark_removed(host.name, ids, remover())
    return {"host": host.name, "workdir": abs_wd, **ans, "removed_ids": ids}


def remover() -> str:
    """Who ran a `gc`: user@machine."""
    import getpass
    import socket

    return f"{getpass.getuser()}@{socket.gethostname()}"


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
    job_path: Path, root: Path, job, trainer_cfg: dict | None, hosts: list[HostConfig], job_id: str, version: str,
    socket: str, *, deploy_first: bool, force: bool, dry_run: bool, accept_new: bool, progress,
) -> LaunchReport:  # fmt: skip
    """One job over several hosts: the same release checked on every node, every node's launch checks passed
    before any starts, then one tmux session per node (head first); a node that refuses at the start stops the
    nodes already started."""
    from dflashctl.remote.session import NodePlace

    port = job.rdzv_port or rdzv_port_for(job.name)
    head = rendezvous_address(hosts[0])
    places = [NodePlace(i, len(hosts), head, port, tuple(job.node_gpus(n)), tuple(n.env.items()))
              for i, n in enumerate(job.nodes)]  # fmt: skip
    runners = [open_runner(h, accept_new) for h in hosts]
    try:
        workdirs, stale = [], []
        for host, runner in zip(hosts, runners, strict=True):
            if deploy_first and not dry_run:
                deploy(runner, root, host.workdir, progress=progress)
            abs_wd, current, _ = read_remote_state(runner, host.workdir)
            workdirs.append(abs_wd)
            if current != version and not (deploy_first and dry_run):
                stale.append(f"{host.name}: deployed code is {current or 'nothing'}")
        if stale:
            raise RefusedError(f"{'; '.join(stale)}; the local tree is {version}: run `dflashctl deploy` on each "
                               "host or launch with --deploy")  # fmt: skip
        sess = session.session_name(job_id)
        # node i > 0 gets a session name of its own: two nodes may share one machine (and its tmux server)
        sessions = [session.node_session(job_id, pl) for pl in places]
        command = job.command or session.trainer_command(job, hosts[0].python, places[0])
        report = LaunchReport(
            id=job_id, host=",".join(h.name for h in hosts), run_dir=f"{workdirs[0]}/runs/{job_id}", session=sess,
            pane_pid=None, release=version, command=command, gpus=list(places[0].gpus), overrides=[], dry_run=dry_run,
        )  # fmt: skip
        report.nodes = [{"host": h.name, "run_dir": f"{wd}/runs/{job_id}", "session": sessions[pl.rank],
                         "pane_pid": None, "gpus": list(pl.gpus), "node_rank": pl.rank}
                        for h, wd, pl in zip(hosts, workdirs, places, strict=True)]  # fmt: skip
        # the head's supervisor probes and restarts the other nodes: how it reaches each, in its supervise.json
        members = [session.member_spec(job_id, pl, h, n, hosts[0], f"{wd}/runs/{job_id}")
                   for h, wd, pl, n in zip(hosts, workdirs, places, job.nodes, strict=True)][1:] \
            if job.watch.supervise else None  # fmt: skip
        files = [session.run_files(job, job_id, h.python, trainer_cfg, version, redact=dry_run, node=pl,
                                   run_dir=f"{wd}/runs/{job_id}", members=members if pl.rank == 0 else None)
                 for h, wd, pl in zip(hosts, workdirs, places, strict=True)]  # fmt: skip
        reqs = [{"action": "launch", "workdir": wd, "job_id": job_id, "name": job.name, "session": sessions[pl.rank],
                 "gpus": list(pl.gpus), "force": force, "release": version, "python": h.python, "tmux_socket": socket,
                 "needs": {"torch": job.trainer is not None, "cuda": bool(pl.gpus)}}
                for h, wd, pl in zip(hosts, workdirs, places, strict=True)]  # fmt: skip
        for h, r, req in zip(hosts, runners, reqs, strict=True):  # every node must pass before any starts
            ans = session.call_agent(r, {**req, "check_only": True, "skip_release": deploy_first and dry_run})
            _raise_refusal(ans, h, job_path)
        if dry_run:
            report.files = files[0]
            report.remote_commands = [r.describe(shown_argv(h.python, "probe", json.dumps(req)))
                                      for h, r, req in zip(hosts, runners, reqs, strict=True)]  # fmt: skip
            return report
        members: list[Member] = []
        try:
            for i, (h, r, req, f) in enumerate(zip(hosts, runners, reqs, files, strict=True)):
                ans = session.call_agent(r, req, payload=json.dumps(f).encode())
                _raise_refusal(ans, h, job_path)
                members.append(Member(node=i, host_name=h.name, host=h, run_dir=ans["run_dir"], session=sessions[i],
                                      pane_pid=ans["pane_pid"], gpus=list(places[i].gpus)))  # fmt: skip
                report.overrides += [f"{h.name}: {o}" for o in ans.get("overrides", [])]
                report.remote_commands += [r.describe(shown_argv(h.python, "probe", json.dumps(req))),
                                           *([ans["started"]] if ans.get("started") else [])]  # fmt: skip
        except Exception:
            for m, r in zip(members, runners, strict=False):  # never leave half a job running
                rec = JobRecord(id=job_id, name=job.name, project=str(root), job_file=str(job_path),
                                host_name=m.host_name, host=m.host, release=version, command=command,
                                run_dir=m.run_dir, session=m.session, launched_at=time.time(), tmux_socket=socket,
                                kill_grace_s=5.0)  # fmt: skip
                control.stop(r, rec, 5.0)
            raise
    finally:
        for r in runners:
            r.close()
    report.run_dir, report.pane_pid = members[0].run_dir, members[0].pane_pid
    for node, m in zip(report.nodes, members, strict=True):
        node.update(run_dir=m.run_dir, pane_pid=m.pane_pid)
    registry.record(JobRecord(
        id=job_id, name=job.name, project=str(root), job_file=str(job_path.resolve()), host_name=hosts[0].name,
        host=hosts[0], release=version, command=command, run_dir=members[0].run_dir, session=sess,
        pane_pid=members[0].pane_pid, gpus=members[0].gpus, launched_at=time.time(), kill_grace_s=job.kill_grace_s,
        is_trainer=job.trainer is not None, overrides=report.overrides, tmux_socket=socket,
        watch=job.watch.model_copy(update={"startup_budget_s": job.startup_budget(trainer_cfg)}),
        steps=(trainer_cfg or {}).get("steps"), members=members,
    ))  # fmt: skip
    return report


def _raise_refusal(ans: dict, host: HostConfig, job_path: Path) -> None:
    if ans.get("refused"):
        if ans.get("config"):
            raise ConfigError(str(job_path), ans.get("key"), f"{'; '.join(ans['refused'])} (host {host.name})")
        raise RefusedError(f"{host.name}: {'; '.join(ans['refused'])} (use --force to launch anyway)")


def find_job(spec: str | None, project: str | None, live_only: bool = False) -> JobRecord:
    """The job a command means, one rule for every command: by id, a unique id prefix or a name (newest match).
    Without one: a job whose last kill failed (retrying `kill` reaches the same job, never the next one), else the
    newest job that may be running, else (unless `live_only`) the newest job of the project."""
    everywhere = registry.all_jobs()  # one read of the records serves every lookup below
    jobs = [j for j in everywhere if project is None or j.project == project]
    if spec:
        exact = [j for j in everywhere if j.id == spec]
        named = [j for j in jobs if j.name == spec]
        # a prefix looks in this project first: another project's jobs are offered only when none here matches
        prefixed = [j for j in jobs if j.id.startswith(spec)] or [j for j in everywhere if j.id.startswith(spec)]
        if not exact and not named and len(prefixed) > 1:  # a prefix must name one job, never guess among several
            ids = ", ".join(j.id for j in prefixed[:8])
            raise NoSuchJobError(f"{spec!r} is a prefix of {len(prefixed)} jobs: {ids}; give more of the id")
        jobs = exact or named or prefixed
    else:
        failed = [j for j in jobs if j.state == "KILL_FAILED"]
        alive = [j for j in jobs if j.live]
        jobs = failed or alive or ([] if live_only else jobs)
    if not jobs:
        what = f"matching {spec!r}" if spec else ("alive " if live_only else "") + "in this project"
        elsewhere = "" if spec or not everywhere else "; jobs of other projects: `dflashctl ls --all-projects`"
        raise NoSuchJobError(f"no job {what} (see `dflashctl ls`){elsewhere}")
    return jobs[0]


def picked_how(job: JobRecord, spec: str | None) -> str:
    """How a command came to its job: `given`, `kill_failed`, `live` or `newest` (said to the user)."""
    if spec:
        return "given"
    return "kill_failed" if job.state == "KILL_FAILED" else ("live" if job.live else "newest")


def kill(spec: str | None, project: str, grace_s: float | None = None, accept_new: bool = False,
         confirm: Callable[[JobRecord], bool] | None = None) -> KillReport:  # fmt: skip
    """Stop a job and record what was verified: KILLED only when nothing of it is left, else KILL_FAILED. A bare
    `kill` with nothing alive kills nothing and says so; an ended job (CRASHED, ...) keeps its state when the kill
    found nothing of it. A bare `kill` retries a failed kill at once, but stops the newest live job only when
    `confirm` says yes (the user was asked, or passed --yes)."""
    if spec is None:
        try:
            job = find_job(None, project, live_only=True)
        except NoSuchJobError:
            raise NothingToDoError("no job of this project is alive: nothing to kill (see `dflashctl ls`)") from None
        if job.state != "KILL_FAILED" and not (confirm and confirm(job)):
            raise ConfigError("kill", None, f"no job named: `dflashctl kill {job.id}` stops the newest alive job "
                              "(or `dflashctl kill --yes`)")  # fmt: skip
    else:
        job = find_job(spec, project)
    if job.state in DONE_FOR_GOOD:  # nothing to stop: say so, rewrite nothing
        raise NothingToDoError(f"{job.id} is already {job.state}: nothing to kill")
    report = control.stop_all(job, lambda h: open_runner(h, accept_new), grace_s)
    ended = not job.live and job.state != "KILL_FAILED" and not report.found and report.clean
    if report.ended_before is not None and report.clean:  # it had ended by itself: that verdict stands
        st = status(job.id, project, accept_new)
        report.verdict = {k: st[k] for k in ("state", "reason", "evidence", "advice")}
        ended = True
    if not ended:
        registry.update(job.id, state=report.result, killed_at=time.time())
        report.notices = _page_kill(job, report, accept_new)
    registry.append_event(job.id, {"decision": "kill", "result": report.result, "signalled": report.term,
                                   "remaining": report.remaining})  # fmt: skip
    return report


def _page_kill(job: JobRecord, report: KillReport, accept_new: bool) -> dict:
    """A kill of a live job pages, once (its id is the job's end: a watch that saw it makes the same one): KILLED, or
    KILL_FAILED naming what survived; with what still waits in the outbox, sent within the budget."""
    if not job.watch.notify.webhook:
        return {}
    from dflashctl.judge.facts import ADVICE
    from dflashctl.judge.notice import Message, notice_id

    survived = [f"pid {p} survived SIGKILL" for p in report.remaining[:5]]
    survived += [f"pid {g.get('pid')} still holds GPU {g.get('index')}" for g in report.gpu_holders[:5]
                 if isinstance(g, dict)]  # fmt: skip
    failed = report.result != "KILLED"
    msg = Message(job.id, job.host_name, report.result, "stopped by `dflashctl kill`" + (": not everything ended"
                  if failed else ", verified: nothing of it is left"), survived, ADVICE.get(report.result),
                  job.restarts, time.time(), failed, 0, f"dflashctl status {job.id}", notice_id(None, report.result),
                  "killed" if not failed else "kill failed")  # fmt: skip
    w = make_watcher(job, accept_new, by="kill")
    try:
        w.links[0].connect()
        return w.deliver([msg])
    except DflashError:
        return {}
    finally:
        for link in w.links:
            link.drop()


def status(spec: str | None, project: str, accept_new: bool = False) -> dict:
    """One look and a verdict: the supervisor's own (its verdict.json) while it answers, else the job's Decider's,
    said so. Without a spec, the same job `kill` would pick (else the newest of the project). Notices the look's
    decider made, and what waits in the outbox, are sent within notify.SEND_BUDGET_S; how many still wait is said."""
    job = find_job(spec, project)
    picked = picked_how(job, spec)
    if job.state == registry.REMOVED:  # gc removed the run dir: no host can say more than the record
        from dflashctl.judge.facts import ADVICE

        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(job.removed_at or 0))
        r = Report(job.id, job.host_name, "REMOVED", f"its run dir was removed by {job.removed_by} at {when} "
                   "(dflashctl gc)", [], ADVICE["REMOVED"], restarts=job.restarts,
                   max_restarts=job.watch.max_restarts, decided_why="the record: gc removed the run dir")  # fmt: skip
        return _status_record(r, picked=picked, run_dir=job.run_dir, session="gone", run_dir_exists=False)
    w = make_watcher(job, accept_new, by="status")
    w.look_extra = {"figures": True, "gpus": False, "capture_lines": 5}
    w.claim_in_look = False  # one `notices` call after the verdict puts and claims, within the send budget
    try:
        looks = w.looks()
        if not looks[0].reachable:  # the same word `watch --once` says: UNREACHABLE, with the last state seen
            return unreachable_status(job, picked, looks[0].error)
        turn = w.decider.take(looks, time.monotonic())
        notices = w.deliver(turn.notices) if job.watch.notify.webhook and looks[0].snap is not None else {}
    finally:
        for link in w.links:
            link.drop()
    r = turn.report
    snap = looks[0].snap or {}
    pane = snap.get("session") or {}
    alive = pane.get("exists") and not pane.get("pane_dead")
    nodes = [{"host": n["host"], "state": n["state"]} for n in w.decider.node_states] if job.members else None
    if r.state != "UNREACHABLE":  # a silent scheduler concludes nothing: the record keeps its last state
        registry.update(job.id, state=r.state, reason=r.reason, progress=r.progress())
    for rec, link in zip(job.member_records(), w.links, strict=False):  # ended for good, no supervisor: scrubbed
        at_rest = {**snap, "secrets_at_rest": link.secrets_at_rest}
        if notify.needs_scrub(job, r.state, at_rest):
            with contextlib.suppress(DflashError), open_runner(rec.host, accept_new) as runner:
                session.call_agent(runner, {"action": "scrub", "run_dir": rec.run_dir, "gpus": False})
    events = [m for m in (snap.get("metrics") or {}).get("records", []) if isinstance(m, dict) and "event" in m]
    fig = snap.get("figures") if isinstance(snap.get("figures"), dict) else {}
    if isinstance(fig.get("step"), int) and r.decided_by == HERE:  # one look reads the metrics in part: the file's
        r.step, r.loss = fig["step"], fig.get("last_loss")  # newest, as `report`'s
    return _status_record(
        r, picked=picked, run_dir=job.run_dir, nodes=nodes,
        alive=bool(alive), session="alive" if alive else ("dead" if pane.get("exists") else "gone"),
        run_dir_exists=bool(snap.get("run_dir_exists")), exit_code=snap.get("exit_code"),
        last_event=events[-1] if events else None,
        uptime_s=round(time.time() - job.launched_at, 1) if alive else None,
        processes=len(snap.get("procs") or []),
        heartbeat_age_s=_heartbeat_age(snap), notices=notices or None,
        # the run's numbers over its whole metrics.jsonl, defined once (agent/files.figures) for status and report
        **{k: fig.get(k) for k in ("mean_tokens_per_s", "first_loss", "elapsed_s")},
    )  # fmt: skip


def notice_log(spec: str | None, project: str, accept_new: bool = False) -> dict:
    """`dflashctl notices`: every notice of the job and how each delivery went (when, by whom, the answer), with the
    webhook named as `scheme://host:port/***`."""
    from dflashctl.judge.redact import redact_url

    job = find_job(spec, project)
    with open_runner(job.host, accept_new) as runner:
        ans = session.call_agent(runner, {"action": "notice_log", "run_dir": job.run_dir, "gpus": False})
    hook = job.watch.notify.webhook
    notices = ans.get("notices") if isinstance(ans.get("notices"), list) else []
    return {"id": job.id, "webhook": redact_url(hook) if hook else None, "run_dir_exists": ans.get("run_dir_exists"),
            "notices": redactor(job).deep(notices)}  # fmt: skip


def _heartbeat_age(snap: dict) -> float | None:
    """How long the trainer's heartbeat has not changed: the remote's monotonic age of it, else its mtime's age."""
    age = (snap.get("progress") or {}).get("heartbeat_age_s")
    if isinstance(age, (int, float)) and not isinstance(age, bool):
        return age
    return (snap.get("heartbeat") or {}).get("age_s")


STATUS_EXTRAS = ("run_dir", "picked", "nodes", "alive", "session", "run_dir_exists", "exit_code", "last_event",
                 "uptime_s", "processes", "heartbeat_age_s", "mean_tokens_per_s", "first_loss", "elapsed_s",
                 "last_state", "last_seen", "notices")  # fmt: skip


def _status_record(r: Report, **known) -> dict:
    """`status --json`: the Report (the one schema of every command) and what only a one-shot look knows; every
    key there, null where the look could not say."""
    record = {**r.to_dict(), **dict.fromkeys(STATUS_EXTRAS)}
    record.update(known)
    return record


def unreachable_status(job: JobRecord, picked: str, why: str) -> dict:
    """`status` of a job whose host does not answer: UNREACHABLE, with the last state recorded and when."""
    from dflashctl.judge.facts import ADVICE

    seen = job.since if isinstance(job.since, (int, float)) and job.since else None
    when = f", recorded {time.time() - seen:.0f} s ago" if seen else ""
    r = Report(job.id, job.host_name, "UNREACHABLE", why, [f"last state {job.state}{when}"], ADVICE["UNREACHABLE"],
               restarts=job.restarts, max_restarts=job.watch.max_restarts, decided_why="the host did not answer")
    return _status_record(r, picked=picked, run_dir=job.run_dir, session="unknown", last_state=job.state,
                          last_seen=seen)  # fmt: skip


def histories(specs: list[str], project: str, accept_new: bool = False) -> list[tuple[JobRecord, dict]]:
    """Each job's metrics, GPU history and watch decisions, one remote call per job (running or finished).
    No spec: the newest job of the project."""
    jobs = [find_job(s, project) for s in specs] if specs else [find_job(None, project)]
    out = []
    for job in jobs:
        with open_runner(job.host, accept_new) as runner:
            hist = session.call_agent(runner, {"action": "history", "run_dir": job.run_dir, "gpus": False})
        if not hist.get("run_dir_exists"):
            raise RefusedError(f"{job.id}: its run dir {job.run_dir} is gone from {job.host_name}")
        out.append((job, redactor(job).deep(hist)))
    return out


LOG_TAIL_BYTES = 4 << 20  # `logs -n N` reads at most this much from the end, however long the lines are


def logs(
    spec: str | None, project: str, lines: int = 50, follow: bool = False, emit: Callable[[str], None] = print,
    poll_s: float = 2.0, accept_new: bool = False, node: str | None = None,
) -> dict:  # fmt: skip
    """Print the last `lines` lines of train.log (a multi-node job: the head's, or `node`'s); with follow, keep
    printing until the job has ended."""
    job = find_job(spec, project)
    if node is not None:
        job = job.member(node)
    clean = redactor(job)  # the job printed its secrets maybe: never shown
    emit = (lambda text, show=emit: show(clean.chunk(text))) if clean else emit
    with open_runner(job.host, accept_new) as runner:
        got = session.call_agent(runner, {"action": "tail", "path": f"{job.run_dir}/train.log", "lines": lines,
                                          "limit": LOG_TAIL_BYTES, "gpus": False})  # fmt: skip
        if not got.get("exists"):
            raise RemoteCommandError(f"{job.id}: cannot read train.log: {got.get('error')}")
        if got["text"]:
            emit(got["text"])
        offset = got["size"]
        snap: dict = {}
        while follow:
            req = {**session.probe_request(job, log_offset=offset, capture_lines=0), "gpus": False}
            snap = session.call_agent(runner, req)
            new = snap.get("log", {})
            if new.get("text"):
                emit(new["text"].rstrip("\n"))
            offset = new.get("offset", offset)
            pane = snap["session"]
            if snap.get("exit_code") is not None or not pane.get("exists") or pane.get("pane_dead"):
                break
            time.sleep(poll_s)
    return {"id": job.id, "exit_code": snap.get("exit_code") if follow else None}
