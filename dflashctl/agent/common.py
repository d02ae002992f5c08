"""What every remote action needs, once: an exclusive lock, an atomic write, a process's identity, bounded reads.

Part of the remote agent (stdlib only, Python 3.8+): see dflashctl/agent/__init__.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time

AGENT_FILE = "agent.pyz"  # the agent's copy in a run dir: the tmux pane runs it as the job's launcher
STOP_REQUEST, STOP_RESULT, RESTARTS, WRAPPER_PID = "stop_request", "stop_result", "restarts", "wrapper.pid"


class LockTimeout(TimeoutError):
    """Another dflashctl holds the lock for longer than the caller will wait."""


@contextlib.contextmanager
def locked(path: str, timeout: float = 120.0, held_by: str = "another dflashctl"):
    """An exclusive lock on `path` (created 0600), held for the block; waits at most `timeout` seconds. A symlink in
    its place is refused (ELOOP), never followed: a lock never creates a file outside its folder."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise LockTimeout(f"{path} is held by {held_by}") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    """Every byte written: a short write (a nearly full disk) is finished or fails, never left half."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_atomic(path: str, data: bytes, mode: int = 0o600) -> None:
    """`path` holds `data` whole (fsynced) or keeps what it held: a new temp file beside it (never through a link
    someone planted: created exclusively), then rename, which replaces a link at `path` rather than its target."""
    tmp = f"{path}.tmp{os.getpid()}.{os.urandom(4).hex()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def append_jsonl(path: str, records: list[dict]) -> None:
    """One JSON object a line, appended in one write (0600 on creation; never through a symlink in its place)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "a") as f:
        f.write("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), or None when it is gone or a zombie (which holds no
    memory and no GPU). With the pid it names one process for good: a later process reusing the pid differs."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        rest = stat[stat.rindex(")") + 2 :].split()
        return None if rest[0] in ("Z", "X") else int(rest[19])
    except (OSError, ValueError, IndexError):
        return None


def read_json(path: str, limit: int = 1 << 20):
    """The JSON in the first `limit` bytes of `path`, or None (missing, unreadable, not JSON)."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read(limit))
    except (OSError, ValueError):
        return None


def read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read(64).strip())
    except (OSError, ValueError):
        return None


SECRET_FILES = ("run.sh", "env.sh")  # where a job's secrets are at rest on the remote: its environment's one file


def scrub_secrets(run_dir: str) -> list[str]:
    """The job ended for good: the values of its secrets (job.json's `secret_names`) are replaced by *** in the one
    file that held them, written anew (temp file and rename). Returns the names scrubbed."""
    meta = read_json(os.path.join(run_dir, "job.json"))
    names = [n for n in (meta.get("secret_names") or []) if isinstance(n, str)] if isinstance(meta, dict) else []
    if not names:
        return []
    done = []
    for name in SECRET_FILES:
        path = os.path.join(run_dir, name)
        try:
            with open(path, "rb") as f:
                lines = f.read().decode("utf-8", "surrogateescape").split("\n")
        except OSError:
            continue
        out = []
        for line in lines:
            key = line[len("export ") :].split("=", 1)[0] if line.startswith("export ") and "=" in line else None
            if key in names:
                line = f"export {key}='***'  # scrubbed: the job ended for good"
                done.append(key)
            out.append(line)
        if done:
            write_atomic(path, "\n".join(out).encode("utf-8", "surrogateescape"))
    done += _scrub_env_file(os.path.join(run_dir, "job.env"), names)
    return done


def _scrub_env_file(path: str, names: list[str]) -> list[str]:
    """job.env's NUL-separated KEY=VALUE records: every secret's whole value (newlines and all) becomes ***."""
    try:
        with open(path, "rb") as f:
            records = f.read().split(b"\0")
    except OSError:
        return []
    done, keys = [], {n.encode(): n for n in names}
    for i, rec in enumerate(records):
        key = rec.split(b"=", 1)[0]
        if key in keys and b"=" in rec and rec != key + b"=***":
            records[i] = key + b"=***"
            done.append(keys[key])
    if done:
        write_atomic(path, b"\0".join(records))
    return done
