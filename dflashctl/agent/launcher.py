"""Runs ON the remote as the job's tmux pane: `python3 agent.pyz launch RUN_DIR [ARGS...]`.

It makes itself a child subreaper (PR_SET_CHILD_SUBREAPER), so every descendant of the job stays in its tree: torchrun
workers in new sessions, `setsid` or double-forked children, children that scrub their environment. It records
itself as (pid, start time) in `wrapper.pid`, runs `bash run.sh ARGS`, reaps whatever is reparented to it, and once
run.sh has ended (it writes `exit_code`), stops what is left of the job: nothing of a job outlives it. First it
starts the job's supervisor (agent/supervise.py) outside that tree, where the run dir asks for one.

A queued job's pane (`launch --queue`: the run dir holds a ticket, agent/queue.py) first waits for its GPUs, then is
respawned as this launcher. A stop request found before run.sh starts ends it there: nothing of the job runs.
`python3 agent.pyz launch --setup RUN_DIR` is run.sh's setup step (agent/setup.py), in the job's environment.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time

from .common import STOP_REQUEST, start_time

PR_SET_CHILD_SUBREAPER = 36
LEFTOVER_GRACE_S = 5.0


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
                children.setdefault(int(stat[stat.rindex(")") + 2 :].split()[1]), []).append(int(name))
            except (OSError, ValueError, IndexError):
                continue
    found, stack = [], list(children.get(root, []))
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    return found


def oom_baseline() -> dict:
    """The file that counts this job's OOM kills (cgroup v2 `memory.events`, v1 `memory.oom_control`, the job's own
    cgroup else the namespace's root) and its count now, so that a probe can tell the kills of this attempt."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    v2 = next((ln[3:] for ln in lines if ln.startswith("0::")), None)
    v1 = next((ln.split(":", 2)[2] for ln in lines if ln.split(":")[1:2] == ["memory"]), None)
    candidates = []
    if v2 is not None:
        candidates += [os.path.join("/sys/fs/cgroup", v2.lstrip("/"), "memory.events"), "/sys/fs/cgroup/memory.events"]
    if v1 is not None:
        root = "/sys/fs/cgroup/memory"
        candidates += [
            os.path.join(root, v1.lstrip("/"), "memory.oom_control"),
            os.path.join(root, "memory.oom_control"),
        ]
    for path in candidates:
        try:
            with open(path) as f:
                count = next(int(ln.split()[1]) for ln in f if ln.startswith("oom_kill "))
            return {"oom_file": path, "oom_kill": count}
        except (OSError, ValueError, StopIteration, IndexError):
            continue
    return {}


def reap_all() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main() -> int:
    if sys.argv[1:2] == ["--setup"]:  # run.sh's setup step, in the job's environment and release
        from .setup import main as setup_main

        return setup_main(sys.argv[2])
    run_dir, args = sys.argv[1], sys.argv[2:]
    from . import queue
    from .supervision import spawn

    spawn(run_dir)  # before this process is a subreaper: the supervisor must not be in the job's tree
    if queue.waiting(queue.entry(run_dir)):
        from .waiter import wait_then_start

        if not wait_then_start(run_dir):
            return 0  # stopped while queued (or respawned as the job's launcher): nothing of the job ran here
    if os.path.exists(os.path.join(run_dir, STOP_REQUEST)):  # a kill came before the command started
        return 0
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    me = os.getpid()
    os.environ["DFLASHCTL_AGENT_PYTHON"] = sys.executable  # run.sh's setup step runs this agent with it
    child = subprocess.Popen(["bash", "--noprofile", "--norc", os.path.join(run_dir, "run.sh"), *args])
    record = {
        "pid": me,
        "start": start_time(me),
        "child": child.pid,
        "child_start": start_time(child.pid),
        **oom_baseline(),
    }
    tmp = os.path.join(run_dir, f"wrapper.pid.tmp{me}")
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), "w") as f:
        json.dump(record, f)
    os.replace(tmp, os.path.join(run_dir, "wrapper.pid"))
    queue.started(run_dir)  # after wrapper.pid: a look never sees neither the ticket nor this attempt's start

    def forward(signum, _frame) -> None:  # the session was closed or we were told to stop: so is the job
        for pid in descendants(me):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in an attached pane reaches the job, not its keeper
    while True:
        try:
            status = child.wait()
            break
        except InterruptedError:
            continue
    reap_all()
    left = descendants(me)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        reap_all()
        left = descendants(me)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10  # a process in uninterruptible sleep dies when the kernel lets it
    while descendants(me) and time.monotonic() < deadline:
        time.sleep(0.05)
        reap_all()
    status = status if status >= 0 else 128 - status
    with contextlib.suppress(Exception):  # no supervisor and no restart to follow: no secret stays at rest
        from .common import scrub_if_unsupervised_end

        scrub_if_unsupervised_end(run_dir, status)
    return status


if __name__ == "__main__":
    sys.exit(main())
