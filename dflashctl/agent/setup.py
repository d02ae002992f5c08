"""The job file's `setup:` (`pip install -r requirements.txt`): run once per release of the code on a host, before the
job's command, by run.sh (`agent.pyz launch --setup RUN_DIR`, in the job's environment and its release's folder).
Part of the remote agent (stdlib only).

Success is recorded per release and setup command in the workdir (`setup/<release>/<key>.json`): a later launch or
a restart of the same release skips it. Two launches at once take the same lock (`<key>.lock`): the second waits
for the first and then skips. The output goes to the run dir's `setup.log`; this attempt's step is `setup.json`
there (waiting, running, done, failed: what the judge reads). A setup that fails or outlives `setup_timeout_s` (its
process group stopped) fails the job as SETUP_FAILED, which is never restarted; no success is recorded then, so the
next launch tries again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import time

from .common import LockTimeout, append_text, locked, open_regular, read_json, read_regular, write_atomic
from .files import tail_lines

SCRIPT, STATE, LOG = "setup.sh", "setup.json", "setup.log"  # in the run dir
DONE_DIR = "setup"  # in the workdir: setup/<release>/<key>.json once the setup ran to success there
TIMED_OUT = 124  # the exit status of a setup stopped at its timeout (as timeout(1) says it)
TERM_GRACE_S = 5.0  # SIGTERM to SIGKILL for a setup past its timeout
TAIL_LINES = 12  # of setup.log, in setup.json: the verdict's evidence


def stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _tail(run_dir: str) -> list[str]:
    """The last lines of setup.log (its last 16 KiB, bounded however long they are)."""
    text = tail_lines(os.path.join(run_dir, LOG), 1 << 20, 16384)["text"]  # every line of those 16 KiB
    lines = [ln.rstrip()[:300] for ln in text.splitlines() if ln.strip() and not ln.startswith("[dflashctl] ")]
    return lines[-TAIL_LINES:]  # the setup's own lines, not ours


class Step:
    """This attempt's setup step as setup.json says it, rewritten at each change."""

    def __init__(self, run_dir: str, command: str, release: str, timeout_s: float) -> None:
        self.run_dir = run_dir
        self.body = {
            "state": "waiting",
            "command": command[:300],
            "release": release,
            "timeout_s": timeout_s,
            "since": round(time.time(), 3),
            "seconds": None,
            "exit": None,
            "timed_out": False,
            "skipped": False,
            "by": None,
            "tail": [],
        }
        self.t0 = time.monotonic()

    def write(self, **changes) -> None:
        self.body.update(changes, seconds=round(time.monotonic() - self.t0, 2))
        with contextlib.suppress(OSError):
            write_atomic(os.path.join(self.run_dir, STATE), json.dumps(self.body).encode())


def log(run_dir: str, line: str) -> None:
    """A line of ours in setup.log, and on stdout (run.sh copies it into train.log)."""
    print(f"[dflashctl] {stamp()} setup: {line}", flush=True)
    with contextlib.suppress(OSError):
        append_text(os.path.join(run_dir, LOG), f"[dflashctl] {stamp()} {line}\n")


def done_record(path: str, key: str, release: str) -> dict | None:
    rec = read_json(path, limit=1 << 16)
    return rec if isinstance(rec, dict) and rec.get("key") == key and rec.get("release") == release else None


def run_command(run_dir: str, timeout_s: float) -> tuple[int, bool]:
    """setup.sh in this process's folder and environment (run.sh's: the release, job.env), its output appended to
    setup.log; its own process group, stopped whole past `timeout_s`. (exit status, timed out)."""
    fd = open_regular(os.path.join(run_dir, LOG), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    if fd is None:
        raise FileNotFoundError(os.path.join(run_dir, LOG))
    with os.fdopen(fd, "ab") as out:
        proc = subprocess.Popen(
            ["bash", "--noprofile", "--norc", os.path.join(run_dir, SCRIPT)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        return proc.wait(timeout=timeout_s), False
    except subprocess.TimeoutExpired:
        for sig, wait in ((signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        return TIMED_OUT, True


def main(run_dir: str) -> int:
    """The setup step: 0 when it ran to success now or had for this release already, else its exit status."""
    meta = read_json(os.path.join(run_dir, "job.json"))
    meta = meta if isinstance(meta, dict) else {}
    job = meta.get("job") if isinstance(meta.get("job"), dict) else {}
    release, job_id = str(meta.get("release") or ""), str(meta.get("id") or os.path.basename(run_dir))
    limit = job.get("setup_timeout_s")
    number = isinstance(limit, (int, float)) and not isinstance(limit, bool)
    timeout_s = float(limit) if number and limit > 0 else 3600.0
    try:
        command = (read_regular(os.path.join(run_dir, SCRIPT), 1 << 20) or b"").decode("utf-8", "surrogateescape")
    except OSError as e:
        log(run_dir, f"cannot read {SCRIPT}: {e}")
        return 1
    shown = command.split("\n", 1)[-1].strip()  # below session.py's header line
    key = hashlib.sha256(command.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    wd = os.path.dirname(os.path.dirname(os.path.abspath(run_dir)))
    folder = os.path.join(wd, DONE_DIR, release)
    done = os.path.join(folder, f"{key}.json")
    step = Step(run_dir, shown, release, timeout_s)

    def skipped(rec: dict) -> int:
        log(
            run_dir,
            f"already done for release {release} by job {rec.get('job')} ({rec.get('seconds')} s): not run again",
        )
        step.write(state="done", skipped=True, by=rec.get("job"), exit=0)
        return 0

    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        rec = done_record(done, key, release)
        if rec is not None:
            return skipped(rec)
        step.write(state="waiting")
        with locked(
            os.path.join(folder, f"{key}.lock"),
            timeout=timeout_s + 60,
            held_by="another launch's setup of this release",
        ):
            rec = done_record(done, key, release)
            if rec is not None:
                return skipped(rec)
            log(run_dir, f"running once for release {release} (output in {LOG}, limit {timeout_s:.0f} s): {shown}")
            step.write(state="running", by=job_id)
            rc, timed_out = run_command(run_dir, timeout_s)
            if rc == 0:
                write_atomic(
                    done,
                    json.dumps(
                        {
                            "key": key,
                            "release": release,
                            "job": job_id,
                            "time": time.time(),
                            "seconds": round(time.monotonic() - step.t0, 2),
                        }
                    ).encode(),
                )
                step.write(state="done", exit=0)
                log(run_dir, f"done in {step.body['seconds']:.1f} s")
                return 0
            why = f"timed out after {timeout_s:.0f} s" if timed_out else f"exit {rc}"
    except LockTimeout as e:
        rc, timed_out, why = 1, True, f"waited {timeout_s + 60:.0f} s for another launch's setup: {e}"
    except OSError as e:
        rc, timed_out, why = 1, False, f"could not run: {e.strerror or e}"
    log(run_dir, f"failed ({why}): the job's command does not start")
    step.write(state="failed", exit=rc, timed_out=timed_out, tail=_tail(run_dir))
    return rc or 1
