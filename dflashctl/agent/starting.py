"""Starting a job: `launch` (checks and start under a host-wide lock) and `restart` (under the run dir's lock, by the
rules every restart keeps). Part of the remote agent (stdlib only)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import time

from ..judge.cause import bounded
from .common import (
    AGENT_FILE,
    RESTART_CAUSE,
    RESTART_LOCK,
    RESTARTS,
    STOP_REQUEST,
    STOP_RESULT,
    WRAPPER_PID,
    locked,
    read_int,
    read_json,
    read_regular,
    write_atomic,
)
from .gpus import gpu_faults, read_gpus
from .procs import TMUX, _run, job_processes, list_sessions, proc_table, slurm_agent, tmux_session
from .stopping import stop_processes

# ---------------------------------------------------------------------------------------------- starting


def pane_command(run_dir: str, python: str, args: list[str]) -> str:
    """What the job's pane runs: the launcher (a child subreaper) on run.sh (a queued job's pane is respawned with
    it when it leaves the queue)."""
    import shlex

    agent = os.path.join(run_dir, AGENT_FILE)
    keeper = [agent, "launch"] if os.path.isfile(agent) else [os.path.join(run_dir, "launcher.py")]  # older run dirs
    # -I -S: the launcher is stdlib only; nothing on PYTHONPATH, in the user's site or the working directory is
    # imported by it (the job it starts still gets the whole environment)
    return "exec " + shlex.join([python, "-I", "-S", *keeper, run_dir, *args])


def session_argv(run_dir: str, session: str, python: str, args: list[str]) -> list[str]:
    """The tmux command that starts the job's session, its pane running `pane_command`."""
    cmd = pane_command(run_dir, python, args)
    return [
        *TMUX,
        "-f",
        os.path.join(run_dir, "tmux.conf"),
        "new-session",
        "-d",
        "-s",
        session,
        "-x",
        "200",
        "-y",
        "50",
        cmd,
        ";",
        "set-option",
        "-w",
        "-t",
        f"={session}:",
        "remain-on-exit",
        "on",
    ]


def start_session(run_dir: str, session: str, python: str, args: list[str]) -> int:
    """Start the job's tmux session (session_argv); the pane's pid."""
    rc, _ = _run(session_argv(run_dir, session, python, args))
    if rc != 0:
        raise RuntimeError(f"tmux could not start session {session}")
    info = tmux_session(session, 0)
    return int(info.get("pane_pid") or 0)


def our_live_jobs(workdir: str, close_ended: bool = True) -> list[dict]:
    """Jobs of ours whose tmux session is alive on this socket (from their run dirs' job.json), after closing the
    sessions of our jobs that have ended (dead pane, exit_code written): their state is in the run dir, and a dead
    pane only kept a pid that may belong to someone else by now. One look at the sessions and the run dirs. A dry
    run (`close_ended` false) closes nothing."""
    sessions = {s["name"]: s["dead"] for s in list_sessions()}
    jobs = []
    runs = os.path.join(workdir, "runs")
    for name in os.listdir(runs) if sessions and os.path.isdir(runs) else []:
        run = os.path.join(runs, name)
        meta = read_json(os.path.join(run, "job.json"))
        session = meta.get("session") if isinstance(meta, dict) else None
        if session not in sessions:
            continue
        if sessions[session]:
            if close_ended and os.path.exists(os.path.join(run, "exit_code")):
                _run([*TMUX, "kill-session", "-t", f"={session}"])
        elif not os.path.exists(os.path.join(run, STOP_RESULT)):
            jobs.append({**meta, "run_dir": run})
    return jobs


MIN_FREE_GIB = 1.0  # a launch needs room for logs and a first checkpoint; doctor warns well before this


def restart_room_gib(state: str, checkpoint_gib: float | None) -> float | None:
    """The free space a restart after `state` needs at the run dir: after DISK_FULL, a checkpoint's (at least what
    a launch needs), so a job that filled its disk is not restarted into it; after anything else, none asked."""
    return max(checkpoint_gib or 0.0, MIN_FREE_GIB) if state == "DISK_FULL" else None


TORCH_CHECK = "import torch; print(torch.__version__, int(torch.cuda.is_available()), torch.cuda.device_count())"
# where torch would come from, without importing it (50 ms against seconds): the key of a cached TORCH_CHECK
TORCH_WHERE = (
    "import importlib.util as u, os, sys; s = u.find_spec('torch'); "
    "print(os.path.realpath(sys.executable), sys.version.split()[0], s.origin if s else '', sep='\\n')"
)
TORCH_CACHE = "torch-check.json"  # in the agent's state dir (~/.cache/dflashctl, 0700), 0600


def _torch_key(python: str) -> str | None:
    """What a successful `import torch` depends on here: the interpreter (real path and version), torch's own files
    (version.py's inode, size and mtime: any reinstall replaces it), the boot, and the NVIDIA driver loaded. None
    when torch is not found (nothing is cached then)."""
    rc, out = _run([python, "-c", TORCH_WHERE], timeout=60)
    lines = out.splitlines()
    if rc != 0 or len(lines) != 3 or not lines[2]:
        return None
    try:
        st = os.stat(os.path.join(os.path.dirname(lines[2]), "version.py"))
    except OSError:
        return None
    parts = [lines[0], lines[1], lines[2], f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"]
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/driver/nvidia/version"):
        try:
            with open(path, "rb") as f:
                parts.append(hashlib.sha256(f.read(4096)).hexdigest()[:16])
        except OSError:
            parts.append("-")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def torch_check(python: str) -> tuple[int, str]:
    """(exit status, "VERSION CUDA_AVAILABLE DEVICES") of importing torch with the job's Python. A launch asks at
    every start, and the import takes seconds (more on a loaded login node): a success is kept under `_torch_key`,
    so the next launch with the same interpreter, torch install, boot and driver reuses it. A failure is never kept
    (the user may fix it); a cache that is garbage, or another user's, is ignored."""
    key = _torch_key(python)
    cache = os.path.join(os.path.dirname(os.path.abspath(sys.argv[0] or ".")), TORCH_CACHE)
    try:  # ours alone: a file of another user, or one others may write, is not believed
        st = os.stat(cache)
        mine = st.st_uid == os.getuid() and not st.st_mode & 0o022
    except OSError:
        mine = False
    known = read_json(cache, limit=1 << 16) if key and mine else None
    known = known if isinstance(known, dict) else {}
    if key and isinstance(known.get(key), str) and len(known[key].split()) == 3:
        return 0, known[key]
    rc, out = _run([python, "-c", TORCH_CHECK], timeout=180)
    if rc == 0 and key and len(out.split()) == 3:
        kept = {k: v for k, v in list(known.items())[-7:] if isinstance(v, str)}  # a few interpreters, not more
        kept[key] = out.strip()
        with contextlib.suppress(OSError):  # a read-only or full home: checked again next time, nothing lost
            write_atomic(cache, json.dumps(kept).encode())
    return rc, out


def preconditions(req: dict, wd: str) -> list[tuple[str, str]]:
    """What the job needs from this host, checked before anything is created: (job file key, problem). A Slurm login
    node needs the scheduler's commands instead of tmux; its Python is not the compute nodes' to judge (`doctor`
    asks a compute node)."""
    problems = []
    scheduled = req.get("scheduler") == "slurm"
    if scheduled:
        problems += [("host.slurm", f"{t} is not on the login node's PATH") for t in slurm_agent().missing_tools()]
    elif not shutil.which("tmux"):
        problems.append(("host", "tmux is not installed on this host"))
    needs = req.get("needs") or {}
    if needs.get("torch") and not scheduled:
        rc, out = torch_check(req["python"])
        if rc != 0:
            problems.append(("host.python", f"{req['python']} cannot import torch (the trainer needs it)"))
        elif needs.get("cuda") and out.split()[1:2] != ["1"]:
            problems.append(("gpus", f"torch {out.split()[0]} on this host has no CUDA (asked for GPUs)"))
    try:
        st = os.statvfs(wd)
        free = st.f_bavail * st.f_frsize / 2**30
        if free < MIN_FREE_GIB:
            problems.append(("host.workdir", f"only {free:.2f} GiB free in {wd} (at least {MIN_FREE_GIB:g} needed)"))
    except OSError:
        pass
    return problems


def make_run_dir(wd: str, job_id: str, files: dict) -> str | None:
    """The run dir (0700) with the launch's files (0600), this very agent (a tmux pane's launcher runs it) and the
    job's inductor cache; None when it exists already (never reused)."""
    run = os.path.join(wd, "runs", job_id)
    try:
        os.mkdir(run, 0o700)
    except FileExistsError:
        return None
    for name, text in files.items():
        write_atomic(os.path.join(run, name), text.encode("utf-8", "surrogateescape"))
    from .pack import own_archive  # zipfile and pathlib: only a launch copies the agent

    write_atomic(os.path.join(run, AGENT_FILE), own_archive())
    os.mkdir(os.path.join(run, "inductor-cache"), 0o700)
    return run


def launch_slurm(req: dict, payload: bytes) -> dict:
    """A Slurm host: the run dir written as for tmux, then one `sbatch` of its batch script. The scheduler owns the
    GPUs, so there is no GPU check here; sbatch's own refusal (a bad partition, account or time) refuses the launch
    and leaves no run dir. A dry run asks `sbatch --test-only` with the same script."""
    slurm = slurm_agent()
    wd = req["workdir"]
    missing = preconditions(req, wd if os.path.isdir(wd) else os.path.dirname(wd) or "/")
    if missing:
        return {"refused": [m for _, m in missing], "key": missing[0][0], "config": True}
    files = json.loads(payload or b"{}")
    release = os.path.join(wd, "releases", req["release"])
    if not req.get("skip_release") and not os.path.isfile(os.path.join(release, ".dflashctl-manifest.json")):
        return {"refused": [f"release {req['release']} is not deployed in {wd} (run dflashctl deploy)"]}
    if req.get("check_only"):
        if slurm.SCRIPT in files:
            err = slurm.test_only(files[slurm.SCRIPT], wd if os.path.isdir(wd) else "/")
            if err:
                return {"refused": [f"sbatch --test-only: {err}"], "key": "host.slurm", "config": True}
        return {"ok": True, "overrides": []}
    os.makedirs(os.path.join(wd, "runs"), mode=0o700, exist_ok=True)
    run = make_run_dir(wd, req["job_id"], files)
    if run is None:
        return {"refused": [f"run dir {os.path.join(wd, 'runs', req['job_id'])} already exists"]}
    job, err = slurm.submit(run, [])
    if job is None:
        shutil.rmtree(run, ignore_errors=True)  # made by this call a moment ago: nothing of the job ran
        return {"refused": [f"sbatch refused the job: {err}"], "key": "host.slurm", "config": True}
    from .supervision import spawn

    spawn(run)  # on the login node, where it can resubmit the job after Slurm ended it
    return {"run_dir": run, "pane_pid": None, "slurm_job": job, "overrides": []}


QUEUEABLE = ("held", "queued", "unknown")  # what `launch --queue` waits out; a name or a faulty GPU it refuses


def claims(req: dict, wd: str, live: list[dict], ticket: int | None = None) -> tuple[list[tuple[str, str]], dict]:
    """What stands between a launch and its GPUs and name, as (kind, what): `name` (a live job of the same name from
    the same clone), `held` (a GPU a running job of ours was given), `queued` (a GPU a job queued before it waits
    for: first come, first served), `unknown` (a GPU holding memory of a process that is none of ours), `faulty`.
    Second, a refusal no waiting cures (the host shows no GPU, an index out of range), or {}. `ticket`: a queued
    launch's own look (agent/queue.py): jobs queued after it are not ahead of it, and its name was checked when it
    queued; GPU readings it cannot take (no tool in the pane's environment) leave our own jobs' claims to decide."""
    from . import queue

    found: list[tuple[str, str]] = []
    wanted = set(req.get("gpus") or [])
    running = []
    for other in live:
        oid = other.get("id")
        if oid == req.get("job_id"):
            continue
        q = queue.entry(other["run_dir"])
        in_queue = queue.waiting(q)
        if in_queue and (
            ticket is not None and q["ticket"] > ticket or os.path.exists(os.path.join(other["run_dir"], STOP_REQUEST))
        ):
            continue  # behind this one, or being taken out of the queue: it never starts
        running += [] if in_queue else [other]
        same_clone = other.get("project") in (None, req.get("project"))  # another clone's job is another job
        if ticket is None and other.get("name") == req["name"] and same_clone:
            found.append(
                (
                    "name",
                    f"job {oid} of the same name is alive: `dflashctl watch {oid}` follows it, "
                    f"`dflashctl kill {oid}` stops it, --force launches another beside it",
                )
            )
        shared = ",".join(map(str, sorted(wanted & set(other.get("gpus") or []))))
        if shared and in_queue:
            found.append(("queued", f"GPU {shared} promised to job {oid}, queued before this launch"))
        elif shared:
            found.append(("held", f"GPU {shared} held by job {oid}"))
    if not wanted or (ticket is not None and found):
        return found, {}
    gpu = read_gpus(req)
    index = {g["uuid"]: g["index"] for g in gpu["gpus"]}
    if not gpu["gpus"]:
        if ticket is not None:
            return found, {}
        return found, {
            "refused": [f"GPUs {sorted(wanted)} asked for, but this host shows none (NVML, nvidia-smi)"],
            "key": "gpus",
            "config": True,
        }
    bad = sorted(i for i in wanted if i >= len(gpu["gpus"]))
    if bad:
        return found, {
            "refused": [f"index {bad[0]} out of range: this host has {len(gpu['gpus'])} GPUs"],
            "key": "gpus",
            "config": True,
        }
    for i, why in sorted(gpu_faults(gpu["gpus"]).items(), key=lambda kv: str(kv[0])):
        if i is None or i in wanted:
            found.append(("faulty", f"GPU {i if i is not None else '?'} is faulty: {why}"))
    table = proc_table()
    ours: set[int] = set()
    for other in running:
        root = read_json(os.path.join(other["run_dir"], WRAPPER_PID))
        if isinstance(root, dict) and isinstance(root.get("pid"), int):
            ours |= {p["pid"] for p in job_processes(table, root, other.get("id"))}
    for app in gpu["apps"]:
        if index.get(app["gpu_uuid"]) in wanted and app["pid"] not in ours:
            found.append(
                (
                    "unknown",
                    f"GPU {index[app['gpu_uuid']]} has unknown process pid {app['pid']} using {app['used_mib']} MiB",
                )
            )
    return found, {}


def launch(req: dict, payload: bytes) -> dict:
    """Check and start under one host-wide lock, so that two launches at the same moment cannot both take a GPU. With
    `queue`, a launch whose GPUs are held (by a job of ours, a job queued first, an unknown process) is started into
    the host's queue instead of refused: its pane waits for them (agent/queue.py)."""
    if req.get("scheduler") == "slurm":
        return launch_slurm(req, payload)
    from . import queue

    wd = req["workdir"]
    check_only = bool(req.get("check_only"))  # a dry run or a pre-deploy check: every check, nothing written
    if not check_only:
        os.makedirs(os.path.join(wd, "runs"), mode=0o700, exist_ok=True)
        os.chmod(os.path.join(wd, "runs"), 0o700)
    files = json.loads(payload or b"{}")
    missing = preconditions(req, wd if os.path.isdir(wd) else os.path.dirname(wd) or "/")  # outside the lock: slow
    if missing:
        return {"refused": [m for _, m in missing], "key": missing[0][0], "config": True}
    lock = contextlib.nullcontext() if check_only else locked(os.path.join(wd, queue.LAUNCH_LOCK))
    with lock:
        release = os.path.join(wd, "releases", req["release"])
        if not req.get("skip_release") and not os.path.isfile(os.path.join(release, ".dflashctl-manifest.json")):
            return {"refused": [f"release {req['release']} is not deployed in {wd} (run dflashctl deploy)"]}
        live = our_live_jobs(wd, close_ended=not check_only)
        found, config = claims(req, wd, live)
        if config:
            return config
        force = bool(req.get("force"))
        refused = [] if force else [what for _, what in found]
        overrides = [what for _, what in found] if force else []
        queued = bool(refused) and bool(req.get("queue")) and all(kind in QUEUEABLE for kind, _ in found)
        if refused and not queued:
            return {"refused": refused, "queueable": all(kind in QUEUEABLE for kind, _ in found)}
        if check_only:  # a multi-node launch asks every node before starting any
            return {"ok": True, "overrides": overrides, **({"would_queue": refused} if queued else {})}
        run = make_run_dir(wd, req["job_id"], files)
        if run is None:
            return {"refused": [f"run dir {os.path.join(wd, 'runs', req['job_id'])} already exists"]}
        ticket = queue.enqueue(run, wd, req, refused, queue.place(live, 1 << 62)) if queued else None
        pane_pid = start_session(run, req["session"], req["python"], [])
    import shlex

    wait_watched(run, req["session"])
    started = shlex.join(session_argv(run, req["session"], req["python"], []))
    answer = {"run_dir": run, "pane_pid": pane_pid, "overrides": overrides, "started": started}
    if ticket is not None:
        answer["queued"] = {k: ticket[k] for k in ("ticket", "position", "waiting_for", "since")}
    return answer


def wait_watched(run: str, session: str, timeout: float = 30.0) -> None:
    """A launch returns once the job's supervisor has started and read the agent it checks every restart's copy
    against (it writes supervisor.json after): an edit of the run dir's `agent.pyz` after the launch is then always
    caught. Without this wait a loaded host could start the supervisor after the edit, from the edited file. The
    launcher spawns it before it starts run.sh; a pane that died first, or no supervisor (`supervise: false`), ends
    the wait, and a supervisor that never comes is the probe's to say (`supervisor.alive`), not the launch's."""
    from .supervision import SPEC, STATE

    if not os.path.isfile(os.path.join(run, SPEC)):
        return
    deadline, look = time.monotonic() + timeout, 0
    while time.monotonic() < deadline and not os.path.exists(os.path.join(run, STATE)):
        look += 1
        if look % 20 == 0:  # once a second: is the pane still there to start it?
            pane = tmux_session(session, 0)
            if not pane.get("exists") or pane.get("pane_dead"):
                return
        time.sleep(0.05)


def _restart_refused(req: dict, run: str, count: int) -> dict | None:
    """The rules every restart keeps, read under the run dir's lock (`count`: its restarts so far): no restart after
    a stop request, one per failed attempt however many watchers saw it, none beyond `max_restarts`, none into a
    disk that is still full."""
    if os.path.exists(os.path.join(run, STOP_REQUEST)):
        return {"restarted": False, "why": "a stop was requested (dflashctl kill)", "stopped": True}
    if count != int(req["attempt"]):
        return {"restarted": False, "why": f"already restarted by another watcher (restart {count})", "restarts": count}
    if count >= int(req["max_restarts"]):
        return {"restarted": False, "why": f"max_restarts ({req['max_restarts']}) reached", "restarts": count}
    need = req.get("min_free_gib")
    if isinstance(need, (int, float)):
        st = os.statvfs(run)
        free = st.f_bavail * st.f_frsize / 2**30
        if free < need:
            return {
                "restarted": False,
                "restarts": count,
                "why": f"the disk is still full: {free:.2f} GiB free at the run dir, a checkpoint needs {need:.2f} GiB",
            }
    return None


def verify_agent_copy(run: str, agent: bytes | None = None) -> bool:
    """The run dir's `agent.pyz` (which the tmux pane runs as the job's launcher) is the agent doing this restart,
    byte for byte; a copy that differs (edited after launch, or from another dflashctl) is replaced first. True when
    it was replaced."""
    from .pack import own_archive

    want = agent if agent is not None else own_archive()
    path = os.path.join(run, AGENT_FILE)
    try:
        if read_regular(path, len(want) + 1) == want:
            return False
    except OSError:  # unreadable, or not a regular file (the job's doing): replaced below
        pass
    write_atomic(path, want)
    return True


def record_cause(run: str, attempt: int, cause: object) -> None:
    """Why restart `attempt` is done (the failed state, its reason and evidence, who decided), written before the
    count moves: a watcher that sees the count but never polled the failure repeats this instead of guessing. A
    restart that fails after it leaves a cause for an attempt that never began, which no count ever matches until
    a later restart of that number writes its own."""
    body = {**bounded(cause, attempt), "time": round(time.time(), 3)}
    with contextlib.suppress(OSError):  # a full disk loses the cause, never the restart
        write_atomic(os.path.join(run, RESTART_CAUSE), json.dumps(body, separators=(",", ":")).encode())


def restart(req: dict, agent: bytes | None = None) -> dict:
    """One restart of a job, decided and done under the run dir's lock (which `reap` also takes): never after a stop
    request, at most once per failed attempt however many watchers saw it, never beyond `max_restarts`. A Slurm
    job is resubmitted: the old submission cancelled and seen to end first, a failed node excluded from then on."""
    run = req["run_dir"]
    if not os.path.isdir(run):
        return {"restarted": False, "why": "the run dir is gone"}
    scheduled = req.get("scheduler") == "slurm"
    slurm = slurm_agent() if scheduled else None
    if not any(os.path.isfile(os.path.join(run, f)) for f in (AGENT_FILE, "launcher.py")):
        return {"restarted": False, "why": "launched by an older dflashctl (no launcher in its run dir): relaunch it"}
    grace = float(req.get("grace_s", 40))
    with locked(os.path.join(run, RESTART_LOCK), timeout=grace + 60):  # a probe meanwhile says STARTING
        count = read_int(os.path.join(run, RESTARTS)) or 0
        refused = _restart_refused(req, run, count)
        if refused:
            return refused
        record_cause(run, count + 1, req.get("cause"))  # before the old attempt is stopped: the window stays short
        if scheduled:
            old = slurm.current_job(run)
            q = slurm.cancel(old, grace + 30, run) if old else {}
            if q.get("known") is not False and not q.get("final"):
                state = q.get("state") or f"unknown ({q.get('why')})"
                return {"restarted": False, "restarts": count, "why": f"slurm job {old} is still {state} after scancel"}
            slurm.exclude_failed_nodes(run, q)
        stopped = stop_processes(run, None if scheduled else req["session"], req["job_id"], grace)
        if stopped["remaining"]:
            return {
                "restarted": False,
                "why": f"the old attempt survived SIGKILL: pids {stopped['remaining']}",
                "restarts": count,
            }
        for stale in ("exit_code", WRAPPER_PID):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(run, stale))
        if scheduled:
            job, err = slurm.submit(run, list(req.get("args", [])))
            if job is None:
                return {"restarted": False, "why": f"sbatch refused the resubmission: {err}", "restarts": count}
            write_atomic(os.path.join(run, RESTARTS), f"{count + 1}\n".encode())
            from .supervision import spawn

            spawn(run)  # a supervisor that died meanwhile comes back with the resubmission (one per run dir)
            return {"restarted": True, "restarts": count + 1, "pane_pid": None, "slurm_job": job, "stopped": stopped}
        write_atomic(os.path.join(run, RESTARTS), f"{count + 1}\n".encode())
        replaced = verify_agent_copy(run, agent)  # the pane runs it next: never a copy this agent did not check
        pane_pid = start_session(run, req["session"], req["python"], list(req.get("args", [])))
    return {
        "restarted": True,
        "restarts": count + 1,
        "pane_pid": pane_pid,
        "stopped": stopped,
        "agent_replaced": replaced,
    }


def restart_action(req: dict, agent: bytes | None = None) -> dict:
    """The restart action, its outcome typed: `raced` when another decider restarted this attempt first (the run
    dir's count is past the attempt asked for), so that no caller reads it from the words of `why`."""
    ans = restart(req, agent)
    count = ans.get("restarts")
    ans["raced"] = bool(
        not ans.get("restarted")
        and isinstance(count, int)
        and not isinstance(count, bool)
        and count > int(req.get("attempt") or 0)
    )
    return ans
