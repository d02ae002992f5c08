"""The other nodes of a job over several hosts, as its head's supervisor reaches them: one agent action on a member
node through ssh from the head. Part of the remote agent (stdlib only: subprocess and the system's ssh).

The head's `supervise.json` names each member: its host's name, run dir, tmux session, job tag, Python, and `reach`,
the argv that runs a command there from the head (`ssh -o BatchMode=yes ... DEST`, written at launch; empty: the
member is this very machine). The action runs the member's own `agent.pyz` (written into its run dir at launch,
0600 in a 0700 dir) isolated: `python3 -I -S RUN/agent.pyz probe REQUEST`, as the laptop runs the agent. ssh's exit
status 255 (or no answer in time) is a node the head cannot reach; any other failure is a probe that failed there.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess

from .common import AGENT_FILE

SSH_UNREACHABLE = 255  # ssh's own exit status when it could not connect or log in
PROBE_TIMEOUT_S = 30.0  # one look at a member; longer, and it counts as not reached (a watch then decides)


class Unreached(Exception):
    """The head could not reach the member (ssh failed, or no answer in time)."""


class ProbeFailed(Exception):
    """The member answered, but the agent there failed."""


class Member:
    """One member node as the head's spec names it."""

    def __init__(self, spec: dict) -> None:
        self.node = int(spec.get("node") or 0)
        self.host = str(spec.get("host") or f"node{self.node}")
        self.run_dir = str(spec.get("run_dir") or "")
        self.session = str(spec.get("session") or "")
        self.job_id = str(spec.get("job_id") or "")
        self.python = str(spec.get("python") or "python3")
        self.tmux_socket = spec.get("tmux_socket")
        reach = spec.get("reach")
        self.reach = [str(a) for a in reach] if isinstance(reach, list) else None  # None: not reachable from here
        prefix = spec.get("prefix")  # a container's exec prefix (`pct exec CT --`), run on the member's host
        self.prefix = [str(a) for a in prefix] if isinstance(prefix, list) else []
        self.gpus = [g for g in spec.get("gpus") or [] if isinstance(g, int)]
        self.why_not = str(spec.get("why_not") or "no way to reach it from the head was given")

    def argv(self, req: dict) -> list[str]:
        """The command that runs one agent action on the member, from the head."""
        inner = [
            *self.prefix,
            self.python,
            "-I",
            "-S",
            os.path.join(self.run_dir, AGENT_FILE),
            "probe",
            json.dumps(req, separators=(",", ":")),
        ]
        if not self.reach:  # this machine (the head and the member share it)
            return inner
        return [*self.reach, shlex.join(inner)]  # ssh joins its arguments with spaces: quoted once, for its shell

    def call(self, req: dict, timeout: float = 60.0) -> dict:
        """One agent action on the member: its JSON answer. Raises Unreached or ProbeFailed."""
        if self.reach is None:
            raise Unreached(self.why_not)
        if self.tmux_socket:
            req = {**req, "tmux_socket": self.tmux_socket}
        try:
            res = subprocess.run(self.argv(req), stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise Unreached(f"no answer from {self.host} in {timeout:.0f} s") from None
        except OSError as e:  # no ssh on the head
            raise Unreached(f"cannot run {self.argv(req)[0]!r} on the head: {e.strerror}") from None
        err = res.stderr.decode("utf-8", "replace").strip()
        if res.returncode == SSH_UNREACHABLE and self.reach:
            raise Unreached(f"ssh from the head to {self.host}: {err.splitlines()[-1] if err else 'exit 255'}"[:300])
        out = res.stdout.decode("utf-8", "replace").strip().splitlines()
        try:
            answer = json.loads(out[-1]) if out else None
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            tail = err[-300:] or f"exit status {res.returncode}, no answer"
            raise ProbeFailed(f"the agent on {self.host} failed: {tail}")
        return answer


def members_of(spec: dict) -> list[Member]:
    return [Member(m) for m in spec.get("members") or [] if isinstance(m, dict)]


def end_member(req: dict) -> dict:
    """The job ended for good (its head's supervisor says so): on this member, once its attempt has ended here (an
    exit status, no launcher alive), its secrets leave the run dir and its tmux session is closed after its pane
    died. Runs ON the member."""
    import time

    from .common import scrub_ended
    from .procs import close_when_dead

    run_dir = req.get("run_dir")
    # its torchrun ends a moment after the head saw the job end (a lost peer): awaited, bounded; a node that still
    # runs after that is left alone and said (`why`)
    deadline = time.monotonic() + float(req.get("wait_s") or 0)
    scrub = scrub_ended(req)
    while scrub.get("why") and time.monotonic() < deadline:
        time.sleep(0.2)
        scrub = scrub_ended(req)
    closed = None
    if isinstance(run_dir, str) and os.path.isfile(os.path.join(run_dir, "exit_code")) and req.get("session"):
        closed = close_when_dead(str(req["session"]))
    return {**scrub, "session_closed": closed}


def look_all(members: list[Member], requests: list[dict]) -> list[tuple[dict | None, bool, str]]:
    """One snapshot of every member, all at once (`requests`: what each is asked, in node order): (snapshot or
    None, reachable, why not) each. The decider (judge/decider.py) takes them."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int):
        m = members[i]
        req = {"run_dir": m.run_dir, "session": m.session, "job_id": m.job_id, **requests[i]}
        try:
            return m.call(req, PROBE_TIMEOUT_S), True, ""
        except Unreached as e:
            return None, False, str(e)
        except ProbeFailed as e:
            return None, True, str(e)

    if not members:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(members))) as pool:
        return list(pool.map(one, range(len(members))))


def act_all(members: list[Member], req: dict, timeout: float) -> list:
    """One action on every member, all at once: (member, answer or None, why not) each, in node order."""
    from concurrent.futures import ThreadPoolExecutor

    def one(m: Member):
        try:
            return (
                m,
                m.call(
                    {**req, "run_dir": m.run_dir, "session": m.session, "job_id": m.job_id, "python": m.python}, timeout
                ),
                None,
            )
        except (Unreached, ProbeFailed) as e:
            return m, None, str(e)

    if not members:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(members))) as pool:
        return list(pool.map(one, members))
