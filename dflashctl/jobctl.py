"""launch, kill, status and logs: each validates first, then talks to the remote through one runner.

A job is found again through the local registry: its host settings, run dir, tmux session and job id are recorded at
launch, so later commands need nothing but the id (or a prefix of it, or nothing for the newest).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from dflashctl import registry, session
from dflashctl.config import HostConfig, resolve_host
from dflashctl.errors import ConfigError, NoSuchJobError, RefusedError, RemoteCommandError
from dflashctl.jobs import JobConfig, load_job
from dflashctl.sync import build_manifest, deploy, manifest_version, read_remote_state
from dflashctl.transport import Runner, open_runner


def new_job_id(name: str, now: datetime | None = None) -> str:
    return f"{name}-{(now or datetime.now(timezone.utc)):%Y%m%dT%H%M%SZ}"


@dataclass
class LaunchPlan:
    """Everything a launch will do, computed before anything changes on the remote."""

    job: JobConfig
    job_id: str
    host: HostConfig
    files: dict[str, bytes]
    local_version: str
    remote_version: str | None
    overrides: list[str] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)


@dataclass
class LaunchReport:
    id: str
    host: str
    run_dir: str
    session: str
    pane_pid: int | None
    code_version: str
    command: str
    gpus: list[int]
    overrides: list[str]
    dry_run: bool
    files: dict[str, str] = field(default_factory=dict)
    remote_commands: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _holders(plan: LaunchPlan, snap: dict) -> list[str]:
    """Who holds the GPUs the job wants: live jobs of ours (registry + live tmux sessions), unknown processes."""
    wanted = set(plan.job.gpu_indices)
    live_sessions = {s["name"] for s in snap.get("sessions", []) if not s["dead"]}
    found = []
    for other in registry.all_jobs():
        if other.get("host_name") != plan.host.name or other.get("session") not in live_sessions:
            continue
        shared = wanted & set(other.get("gpus") or [])
        if shared:
            found.append(f"GPU {','.join(map(str, sorted(shared)))} held by job {other['id']}")
    uuid_index = {g["uuid"]: g["index"] for g in snap.get("gpu", {}).get("gpus", [])}
    for app in snap.get("gpu", {}).get("apps", []):
        idx = uuid_index.get(app["gpu_uuid"])
        if idx in wanted:
            found.append(f"GPU {idx} has unknown process pid {app['pid']} using {app['used_mib']} MiB")
    return found


def plan_launch(
    runner: Runner, job: JobConfig, trainer_cfg: dict | None, job_path: Path, root: Path, force: bool
) -> LaunchPlan:
    """Read-only checks on the remote (code version, GPUs), then the files to write. Raises before any change."""
    host = runner.host
    job_id = new_job_id(job.name)
    local_version = manifest_version(build_manifest(root))
    _, remote = read_remote_state(runner, host.workdir)
    remote_version = manifest_version(remote) if remote else None
    plan = LaunchPlan(job, job_id, host, session.run_files(job, job_id, host.python, trainer_cfg), local_version,
                      remote_version)  # fmt: skip
    if job.gpu_indices:
        snap = session.call_probe(runner, {"gpus": True, "sessions": True, "tmux_socket": session.tmux_socket()})
        gpus = snap.get("gpu", {}).get("gpus", [])
        if gpus:
            bad = [i for i in job.gpu_indices if i >= len(gpus)]
            if bad:
                raise ConfigError(
                    str(job_path), "gpus", f"index {bad[0]} out of range: {host.name} has {len(gpus)} GPUs"
                )
        holders = _holders(plan, snap)
        if holders and not force:
            raise RefusedError(f"{host.name}: {'; '.join(holders)} (use --force to launch anyway)")
        plan.overrides = holders
    return plan


def launch(
    job_path: Path, root: Path, *, deploy_first: bool = False, force: bool = False, dry_run: bool = False,
    accept_new: bool = False, progress=None,
) -> LaunchReport:  # fmt: skip
    socket = session.tmux_socket()
    job, trainer_cfg = load_job(job_path, root)
    host = resolve_host(job.host, root)
    with open_runner(host, accept_new) as runner:
        if deploy_first and not dry_run:
            deploy(runner, root, host.workdir, progress=progress)
        plan = plan_launch(runner, job, trainer_cfg, job_path, root, force)
        if plan.remote_version != plan.local_version and not (deploy_first and dry_run):
            have = plan.remote_version or "nothing"
            raise RefusedError(
                f"{host.name}: deployed code is {have}, the local tree is {plan.local_version}; "
                f"run `dflashctl deploy {host.name}` or launch with --deploy"
            )
        command = job.command or session.trainer_command(job, host.python)
        report = LaunchReport(
            id=plan.job_id, host=host.name, run_dir=f"{host.workdir}/runs/{plan.job_id}",
            session=session.session_name(plan.job_id), pane_pid=None, code_version=plan.local_version,
            command=command, gpus=job.gpu_indices, overrides=plan.overrides, dry_run=dry_run,
        )  # fmt: skip
        if dry_run:
            report.files = {name: data.decode() for name, data in plan.files.items()}
            report.remote_commands = [session.start_command_preview(runner, host.workdir, plan.job_id)]
            return report
        run_dir, pane_pid = session.start(runner, host.workdir, plan.job_id, plan.files, fresh=True,
                                          clear_cache=job.inductor_cache == "clear", socket=socket)  # fmt: skip
    report.run_dir, report.pane_pid = run_dir, pane_pid
    registry.record({
        "id": plan.job_id, "name": job.name, "project": str(root), "job_file": str(job_path.resolve()),
        "host_name": host.name, "host": host.model_dump(), "code_version": plan.local_version, "command": command,
        "run_dir": run_dir, "session": report.session, "pane_pid": pane_pid, "gpus": job.gpu_indices,
        "launched_at": time.time(), "state": "STARTING", "restarts": 0, "kill_grace_s": job.kill_grace_s,
        "is_trainer": job.trainer is not None, "overrides": plan.overrides, "watch": job.watch.model_dump(),
        "tmux_socket": socket,
        "steps": (trainer_cfg or {}).get("steps"),
    })  # fmt: skip
    return report


def relaunch(job_rec: dict, runner: Runner, attempt: int) -> int:
    """Restart a job in its run dir (after a clean kill): the trainer resumes from its newest checkpoint."""
    job, trainer_cfg = load_job(Path(job_rec["job_file"]), Path(job_rec["project"]))
    files = session.run_files(job, job_rec["id"], runner.host.python, trainer_cfg)
    args = ("--resume",) if job.trainer is not None else ()
    _, pane_pid = session.start(runner, runner.host.workdir, job_rec["id"], files, fresh=False, clear_cache=False,
                                wrapper_args=args, socket=job_rec.get("tmux_socket", "dflashctl"))  # fmt: skip
    registry.update(job_rec["id"], pane_pid=pane_pid, restarts=attempt, state="STARTING")
    return pane_pid


def find_job(spec: str | None, project: str | None, live_only: bool = False) -> dict:
    """A job by id, id prefix or name (newest match), or the newest job of the project."""
    jobs = registry.all_jobs(project)
    if live_only:
        jobs = [j for j in jobs if j.get("state") not in ("KILLED", "FINISHED", "LOST")]
    if spec:
        exact = [j for j in registry.all_jobs() if j["id"] == spec]
        jobs = exact or [j for j in jobs if j["id"].startswith(spec) or j.get("name") == spec]
    if not jobs:
        what = f"matching {spec!r}" if spec else ("live " if live_only else "") + "in this project"
        raise NoSuchJobError(f"no job {what} (see `dflashctl ls`)")
    return jobs[0]


def host_of(job_rec: dict) -> HostConfig:
    return HostConfig.model_validate(job_rec["host"])


@dataclass
class KillReport:
    id: str
    host: str
    found: list[dict]
    term: list[int]
    kill: list[int]
    remaining: list[int]
    gpu_holders: list[dict]
    gpu_source: str
    session_closed: bool

    @property
    def clean(self) -> bool:
        return not self.remaining and not self.gpu_holders and self.session_closed

    def to_dict(self) -> dict:
        return {**asdict(self), "clean": self.clean}


def stop(runner: Runner, job_rec: dict, grace_s: float | None = None) -> KillReport:
    grace = job_rec.get("kill_grace_s", 40.0) if grace_s is None else grace_s
    req = {"action": "reap", "session": job_rec["session"], "job_id": job_rec["id"], "grace_s": grace,
           "tmux_socket": job_rec.get("tmux_socket", "dflashctl")}  # fmt: skip
    ans = session.call_probe(runner, req, timeout=grace + 60)
    return KillReport(job_rec["id"], runner.host.name, ans["found"], ans["term"], ans["kill"], ans["remaining"],
                      ans["gpu_holders"], ans["gpu_source"], ans["session_closed"])  # fmt: skip


def kill(spec: str | None, project: str, grace_s: float | None = None, accept_new: bool = False) -> KillReport:
    job_rec = find_job(spec, project, live_only=spec is None)
    with open_runner(host_of(job_rec), accept_new) as runner:
        report = stop(runner, job_rec, grace_s)
    registry.update(job_rec["id"], state="KILLED", killed_at=time.time())
    registry.append_event(job_rec["id"], {"decision": "kill", "clean": report.clean, "signalled": report.term})
    if not report.clean:
        raise RemoteCommandError(
            f"kill {job_rec['id']}: still there after SIGKILL: pids {report.remaining}, GPU holders "
            f"{[a['pid'] for a in report.gpu_holders]}, session closed {report.session_closed}"
        )
    return report


def status(spec: str | None, project: str, accept_new: bool = False) -> dict:
    job_rec = find_job(spec, project)
    with open_runner(host_of(job_rec), accept_new) as runner:
        snap = session.call_probe(runner, {**session.probe_request(job_rec, capture_lines=5), "gpus": False})
    steps = [r for r in snap.get("metrics", {}).get("records", []) if "event" not in r]
    events = [r for r in snap.get("metrics", {}).get("records", []) if "event" in r]
    evals = [r for r in events if r["event"] == "eval"]
    pane = snap["session"]
    alive = pane.get("exists") and not pane.get("pane_dead")
    state, reason = judge(job_rec, snap)
    return {
        "id": job_rec["id"], "host": job_rec["host_name"], "run_dir": job_rec["run_dir"],
        "alive": bool(alive), "session": "alive" if alive else ("dead" if pane.get("exists") else "gone"),
        "run_dir_exists": snap["run_dir_exists"], "exit_code": snap.get("exit_code"),
        "last_step": steps[-1] if steps else None, "last_event": events[-1] if events else None,
        "uptime_s": round(time.time() - job_rec["launched_at"], 1) if alive else None,
        "processes": len(snap.get("procs", [])),
        "state": state, "reason": reason, "restarts": job_rec.get("restarts", 0),
        "heartbeat_age_s": (snap.get("heartbeat") or {}).get("age_s"),
        "tau": evals[-1]["tau"] if evals else None,
        "mean_tokens_per_s": round(sum(r["tokens_per_s"] for r in steps) / len(steps), 1) if steps else None,
    }  # fmt: skip


def judge(job_rec: dict, snap: dict) -> tuple[str, str]:
    """The watch verdict for one snapshot (recorded in the registry); a job we killed stays KILLED."""
    if job_rec.get("state") == "KILLED":
        return "KILLED", "stopped by `dflashctl kill`"
    from dflashctl.health import assess  # watch imports this module: import at call time
    from dflashctl.watch import make_watcher

    w = make_watcher(job_rec)
    w.fold(snap)
    v = assess(w.history, w.thresholds)
    registry.update(job_rec["id"], state=v.state, reason=v.reason)
    return v.state, v.reason


def logs(
    spec: str | None, project: str, lines: int = 50, follow: bool = False, emit: Callable[[str], None] = print,
    poll_s: float = 2.0, accept_new: bool = False,
) -> dict:  # fmt: skip
    """Print the last `lines` lines of train.log; with follow, keep printing until the job has ended."""
    job_rec = find_job(spec, project)
    with open_runner(host_of(job_rec), accept_new) as runner:
        res = runner.run(["tail", "-n", str(lines), f"{job_rec['run_dir']}/train.log"])
        if res.returncode != 0:
            raise RemoteCommandError(f"{job_rec['id']}: cannot read train.log: {res.err.strip()[-200:]}")
        text = res.out
        if text:
            emit(text.rstrip("\n"))
        size_res = runner.run(["stat", "-c", "%s", f"{job_rec['run_dir']}/train.log"])
        offset = int(size_res.out.strip() or 0)
        snap: dict = {}
        while follow:
            req = {**session.probe_request(job_rec, log_offset=offset, capture_lines=0), "gpus": False}
            snap = session.call_probe(runner, req)
            new = snap.get("log", {})
            if new.get("text"):
                emit(new["text"].rstrip("\n"))
            offset = new.get("offset", offset)
            pane = snap["session"]
            if snap.get("exit_code") is not None or not pane.get("exists") or pane.get("pane_dead"):
                break
            time.sleep(poll_s)
    return {"id": job_rec["id"], "exit_code": snap.get("exit_code") if follow else None}
