"""What every remote action needs, once: an exclusive lock, an atomic write, a process's identity, bounded reads.

Part of the remote agent (stdlib only, Python 3.8+): see dflashctl/agent/__init__.py.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import stat
import time

from ..judge import redact

AGENT_FILE = "agent.pyz"  # the agent's copy in a run dir: the tmux pane runs it as the job's launcher
STOP_REQUEST, STOP_RESULT, RESTARTS, WRAPPER_PID = "stop_request", "stop_result", "restarts", "wrapper.pid"
RESTART_LOCK = ".restart.lock"  # held by a restart for its whole length, and by `kill` while it asks for the stop
RESTART_CAUSE = "restart_cause.json"  # why the last restart was done, by whom: for a watcher that never saw it


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


def lock_held(path: str) -> bool:
    """Whether some process holds `path`'s lock now: a shared try, let go at once (a lock dies with its holder, so a
    restart killed halfway is not "in progress" for ever, as a marker file would be). No file: no holder."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
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


def append_text(path: str, text: str) -> None:
    """`text` appended in one write (0600 on creation; never through a symlink in its place, never into a FIFO or
    anything else the job put there: that raises SetAside, an OSError)."""
    fd = open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    if fd is None:  # a dangling path component: nothing to append to
        raise FileNotFoundError(path)
    with os.fdopen(fd, "a") as f:
        f.write(text)


def append_jsonl(path: str, records: list[dict]) -> None:
    """One JSON object a line, appended in one write (append_text)."""
    append_text(path, "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))


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


# ---------------------------------------------------------------------------------------------- untrusted files
# The job can write every file of its run dir: it may put a FIFO, a symlink, a directory, a huge file or nested JSON
# where one of ours should be. Every read of a run dir's file goes through `read_regular`: opened without following
# a link and without blocking (a FIFO would block an open for reading until a writer came), checked to be a regular
# file, bounded in size; JSON is bounded in nesting too. What is set aside is named (SET_ASIDE), never fatal.

MAX_JSON_DEPTH = 32  # none of our files nests deeper; a deeper one is the job's, set aside
SET_ASIDE: list[str] = []  # what was set aside since the last `drain_set_aside` (a look names it in its evidence)
SET_ASIDE_MAX = 20


class SetAside(OSError):
    """A file that is there but cannot be one of ours (not a regular file, a link, too large, not JSON...)."""


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str, flags: int = os.O_RDONLY) -> int | None:
    """An fd of `path` when it is a regular file, opened without following a link or blocking; None when there is
    nothing there. Raises SetAside for anything else there."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise SetAside("a symbolic link") from None
        if e.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO with no reader (opened to write), a directory
            raise SetAside("a FIFO" if e.errno == errno.ENXIO else "a directory") from None
        if e.errno == errno.ENOTDIR:
            return None
        raise
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise SetAside(f"{_kind(mode)}, not a regular file")
    return fd


def read_regular(path: str, limit: int, offset: int = 0) -> bytes | None:
    """At most `limit` bytes of the regular file `path` from `offset`; None when absent. Raises SetAside or OSError."""
    fd = open_regular(path)
    if fd is None:
        return None
    try:
        if offset:
            os.lseek(fd, offset, os.SEEK_SET)
        chunks, left = [], limit
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def set_aside(path: str, why: str) -> None:
    """Say once that a run dir's file was set aside, and why (the look's evidence names it)."""
    line = f"{os.path.basename(path)}: {why}"
    if line not in SET_ASIDE and len(SET_ASIDE) < SET_ASIDE_MAX:
        SET_ASIDE.append(line)


def drain_set_aside() -> list[str]:
    said = list(SET_ASIDE)
    del SET_ASIDE[: len(said)]
    return said


def too_deep(value, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether JSON data nests deeper than `limit` (checked without recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                return True
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return False


def read_json(path: str, limit: int = 1 << 20):
    """The JSON in `path`, or None: absent, or set aside (not a regular file, over `limit` bytes, not JSON, nested
    deeper than MAX_JSON_DEPTH), said through `set_aside`."""
    try:
        data = read_regular(path, limit + 1)
    except SetAside as e:
        set_aside(path, str(e))
        return None
    except OSError as e:
        set_aside(path, e.strerror or type(e).__name__)
        return None
    if data is None:
        return None
    if len(data) > limit:
        set_aside(path, f"over {limit} bytes")
        return None
    if data.count(b"[") + data.count(b"{") > MAX_JSON_DEPTH:  # cheap: few brackets cannot nest deep
        try:
            value = json.loads(data)
        except (ValueError, RecursionError):
            set_aside(path, "not JSON")
            return None
        if too_deep(value):
            set_aside(path, f"nested deeper than {MAX_JSON_DEPTH}")
            return None
        return value
    try:
        return json.loads(data)
    except ValueError:
        set_aside(path, "not JSON")
        return None


def mapping(data, key: str):
    """`data[key]` when `data` is a JSON object, else {} (a file the job rewrote may hold anything)."""
    return data.get(key, {}) if isinstance(data, dict) else {}


def read_int(path: str) -> int | None:
    try:
        data = read_regular(path, 64)
    except SetAside as e:
        set_aside(path, str(e))
        return None
    except OSError:
        return None
    try:
        return int(data.strip()) if data is not None else None
    except ValueError:
        return None


SECRET_FILES = ("run.sh", "env.sh")  # the job's environment as a shell script (env.sh: a Slurm job's)
ENV_FILE = "job.env"  # the same environment, NUL-separated KEY=VALUE records (what exec and shell read)
AT_REST = ".redact.json"  # an ended job's secrets as fingerprints only (judge/redact.py), written before the scrub
_QUOTED = re.compile(r"(?:'[^']*'|\"'\")+|[^\s'\"]+")  # a value as shlex.quote writes it


def _unquote(token: str) -> str:
    """A word shlex.quote wrote (`'a'"'"'b'` or a bare safe word), as the shell reads it."""
    if not token.startswith(("'", '"')):
        return token
    return "".join("'" if seg == '"\'"' else seg[1:-1] for seg in re.findall(r"'[^']*'|\"'\"", token))


def _exports(text: str, names: list[str]) -> list[tuple[str, int, int, str]]:
    """(name, start, end, value) of each `export NAME=value` line of a secret name in a script we wrote."""
    found = []
    for m in re.finditer(r"^export ([A-Za-z_][A-Za-z0-9_]*)=", text, re.MULTILINE):
        if m.group(1) not in names:
            continue
        q = _QUOTED.match(text, m.end())
        if q and _unquote(q.group(0)) != "***":  # scrubbed already
            found.append((m.group(1), q.start(), q.end(), _unquote(q.group(0))))
    return found


def _read_text(path: str) -> str | None:
    try:
        data = read_regular(path, 1 << 22)
    except (OSError, SetAside):
        return None
    return data.decode("utf-8", "surrogateescape") if data is not None else None


def _env_records(path: str) -> list[tuple[str, str]] | None:
    text = _read_text(path)
    if text is None:
        return None
    return [tuple(r.split("=", 1)) for r in text.split("\0") if "=" in r]  # type: ignore[misc]


def secret_values(run_dir: str) -> list[str]:
    """The plain values of the job's secrets this run dir still holds: job.json's `secret_names` read from job.env
    and from run.sh / env.sh, and the webhook URL's secret parts (supervise.json's notify)."""
    meta = read_json(os.path.join(run_dir, "job.json"))
    names = [n for n in (meta.get("secret_names") or []) if isinstance(n, str)] if isinstance(meta, dict) else []
    values = []
    for key, value in _env_records(os.path.join(run_dir, ENV_FILE)) or []:
        if key in names:
            values.append(value)
    for name in SECRET_FILES:
        text = _read_text(os.path.join(run_dir, name))
        values += [v for _, _, _, v in _exports(text, names)] if text else []
    spec = read_json(os.path.join(run_dir, "supervise.json"))
    hook = mapping(mapping(spec, "notify"), "webhook")
    if isinstance(hook, str) and hook != redact.redact_url(hook):  # not yet scrubbed
        values += redact.url_secrets(hook)
    return [v for v in values if v and v != "***"]


def job_redactor(run_dir: str | None):
    """What masks this job's secrets in anything read from its run dir: the plain values it holds while the job can
    still run, the fingerprints kept once it has ended for good, both where both are there."""
    if not run_dir:
        return redact.Redactor()
    rest = read_json(os.path.join(run_dir, AT_REST))
    rest = rest if isinstance(rest, dict) else {}
    return redact.Redactor(
        secret_values(run_dir), str(rest.get("salt") or ""), rest.get("hashed") or [], rest.get("lengths") or []
    )


def scrub_secrets(run_dir: str) -> list[str]:
    """The job ended for good: its secrets leave the run dir whole, every line of a multi-line value too. First
    their fingerprints are kept (`.redact.json`: what later looks mask the log with), then run.sh / env.sh get
    `export NAME='***'` for each secret and job.env `NAME=***`, each written anew (temp file and rename), and any
    other line of those files holding a piece of a secret is masked. Returns the names scrubbed."""
    meta = read_json(os.path.join(run_dir, "job.json"))
    names = [n for n in (meta.get("secret_names") or []) if isinstance(n, str)] if isinstance(meta, dict) else []
    values = secret_values(run_dir)
    if not values:
        return []
    plain = redact.Redactor(values)
    rest = read_json(os.path.join(run_dir, AT_REST))
    kept = (
        rest
        if isinstance(rest, dict) and rest.get("salt")
        else {"salt": os.urandom(16).hex(), "hashed": [], "lengths": []}
    )
    new = plain.fingerprints(bytes.fromhex(kept["salt"]))
    kept = {
        "salt": kept["salt"],
        "hashed": sorted(set(kept["hashed"]) | set(new["hashed"])),
        "lengths": sorted(set(kept["lengths"]) | set(new["lengths"])),
    }
    write_atomic(os.path.join(run_dir, AT_REST), json.dumps(kept).encode())
    done: list[str] = []
    for name in SECRET_FILES:
        path = os.path.join(run_dir, name)
        text = _read_text(path)
        if text is None:
            continue
        out, at = [], 0
        for key, start, end, _ in _exports(text, names):
            out += [text[at:start], "'***'"]
            at = end
            done.append(key)
        scrubbed = plain("".join(out) + text[at:])
        if scrubbed != text:
            write_atomic(path, scrubbed.encode("utf-8", "surrogateescape"))
    records = _env_records(os.path.join(run_dir, ENV_FILE))
    if records:
        clean = [(k, "***" if k in names else plain(v)) for k, v in records]
        done += [k for k, v in records if k in names and v != "***"]
        if clean != records:
            data = "".join(f"{k}={v}\0" for k, v in clean)
            write_atomic(os.path.join(run_dir, ENV_FILE), data.encode("utf-8", "surrogateescape"))
    spec = read_json(os.path.join(run_dir, "supervise.json"))
    hook = mapping(mapping(spec, "notify"), "webhook")
    if isinstance(hook, str) and hook != redact.redact_url(hook):  # the supervisor has sent what it could
        spec["notify"]["webhook"] = redact.redact_url(hook)
        write_atomic(os.path.join(run_dir, "supervise.json"), json.dumps(spec, indent=1).encode())
    return sorted(set(done))


def scrub_if_unsupervised_end(run_dir: str, status: int) -> list[str]:
    """The launcher's last act when no supervisor keeps the job (`supervise: false`, a node of a multi-node job):
    the attempt ended, and when no restart can follow (it succeeded, or the job file allows no more restarts) its
    secrets leave the run dir. A supervised job is scrubbed by its supervisor, which knows the verdict."""
    if os.path.isfile(os.path.join(run_dir, "supervise.json")):
        return []
    meta = read_json(os.path.join(run_dir, "job.json"))
    watch = mapping(mapping(meta, "job"), "watch")
    watch = watch if isinstance(watch, dict) else {}
    most = watch.get("max_restarts") if isinstance(watch.get("max_restarts"), int) else 0
    done = read_int(os.path.join(run_dir, RESTARTS)) or 0
    if status == 0 or not watch.get("restart_on") or done >= most:
        return scrub_secrets(run_dir)
    return []


def scrub_ended(req: dict) -> dict:
    """A local command judged the job ended for good (no supervisor keeps it, no restart follows): its secrets leave
    the run dir, but only once the job's attempt has ended here (an exit status, no launcher alive)."""
    run_dir = req.get("run_dir")
    if not isinstance(run_dir, str) or not os.path.isfile(os.path.join(run_dir, "exit_code")):
        return {"scrubbed": [], "why": "the job has not ended here"}
    me = read_json(os.path.join(run_dir, WRAPPER_PID))
    if isinstance(me, dict) and isinstance(me.get("pid"), int) and start_time(me["pid"]) == me.get("start"):
        return {"scrubbed": [], "why": "its launcher still runs"}
    return {"scrubbed": scrub_secrets(run_dir)}
