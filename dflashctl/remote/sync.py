"""deploy: which files travel, what changed, and how they become an atomic release on the remote.

The files are those git tracks plus untracked files git does not ignore (outside a git checkout: everything but
common junk). Junk patterns (build/, dist/, *.egg-info, *~ ...) apply to untracked files only: what git tracks always
travels. Symlinks inside the tree travel as symlinks; a symlink that leads outside it is refused (its target, say
~/.ssh/config, must never travel). Each entry's sha256 goes into a manifest, whose hash is the code version.

On the remote, code lives in immutable releases: `<workdir>/releases/<version>/`, and `<workdir>/code` is a symlink
to the current one. A deploy is:
  1. one remote command that prints the workdir, the current release and its manifest,
  2. if the version differs, one remote command (the agent's `release`) that receives a tar of the changed files,
     hard-links the unchanged ones from the current release, verifies every file's hash, then switches `code` with one
     rename, all under a lock on the workdir. A failure at any point leaves the previous release current and intact.
Jobs run from their own release (`releases/<version>`), so a deploy never changes the code under a running job.

When this machine deployed to the same host and workdir before (`LastDeploy`, in the state dir), step 1 is skipped:
the changed files are those against the release it last deployed, named as the base to link from. Releases are
immutable and named by their content's hash, so that base is what the cache says wherever `code` points now; a base
that is gone (collected, deleted) is answered `need_full`, and the deploy falls back to steps 1 and 2.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import stat
import subprocess
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

from dflashctl import outputs
from dflashctl.errors import ConfigError, DflashError, RemoteCommandError
from dflashctl.remote.agent_bundle import AGENT, boot_argv, note_noise, split_answer
from dflashctl.remote.deploy_record import (
    AgentPython,
    host_python,
    record_path,
    remember_python,
    write_private_json,
)
from dflashctl.remote.transport import WORKDIR_PRELUDE, Result, Runner

S_IFLNK = 0o120000

MANIFEST_NAME = ".dflashctl-manifest.json"
JUNK_DIRS = {
    ".git",
    ".hg",
    ".svn",
    ".venv",
    "venv",
    "__pycache__",
    "node_modules",
    ".pytest_cache",
    ".ruff_cache",
    ".mypy_cache",
    ".tox",
    ".nox",
    "build",
    "dist",
    ".idea",
    ".vscode",
    ".ipynb_checkpoints",
}
JUNK_SUFFIXES = (".pyc", ".pyo", ".egg-info", ".swp", "~")
JUNK_FILES = {".DS_Store", "Thumbs.db"}
SPOOL_IN_MEMORY = 64 << 20  # tar streams larger than this go to a temporary file


@dataclass(frozen=True)
class Entry:
    sha256: str
    size: int
    mode: int  # permission bits; the executable bit matters for scripts

    def to_json(self) -> list:
        return [self.sha256, self.size, self.mode]


Manifest = dict[str, Entry]


@dataclass
class DeployReport:
    """What a deploy did (or, with dry_run, would do). The JSON the CLI prints."""

    host: str
    code_dir: str
    version: str
    files_sent: int = 0
    files_deleted: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0
    dry_run: bool = False
    remote_commands: int = 0
    sent: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, host: str, abs_wd: str, version: str, plan: Plan, **more) -> DeployReport:
        """The report of `plan` (what is sent and deleted) for the release `version` under the workdir `abs_wd`."""
        return cls(
            host=host,
            code_dir=f"{abs_wd}/code",
            version=version,
            files_sent=len(plan.send),
            files_deleted=len(plan.delete),
            sent=plan.send,
            deleted=plan.delete,
            **more,
        )

    def to_dict(self) -> dict:
        return asdict(self)


def _is_junk(rel: str) -> bool:
    """A POSIX relative path (strings: this runs once per untracked file) under a junk folder, or a junk file."""
    *dirs, name = rel.split("/")
    return (
        any(part in JUNK_DIRS or part.endswith(".egg-info") for part in dirs)
        or name in JUNK_FILES
        or name.endswith(JUNK_SUFFIXES)
    )


def _git_files(root: Path, *args: str) -> list[str]:
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", *args], capture_output=True, check=True).stdout
    return [p for p in out.decode("utf-8", "surrogateescape").split("\0") if p]


def _walk(root: Path) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        links = [d for d in dirnames if (Path(dirpath) / d).is_symlink()]  # travel as links, never followed
        dirnames[:] = [d for d in dirnames if d not in JUNK_DIRS and not d.endswith(".egg-info") and d not in links]
        found += [(rel_dir / f).as_posix() for f in filenames + links]
    return found


def _inside(root: Path, link: Path) -> bool:
    target = os.readlink(link)
    if os.path.isabs(target):
        return False
    resolved = os.path.normpath(os.path.join(os.path.dirname(os.path.relpath(link, root)), target))
    return not (resolved == ".." or resolved.startswith("../"))


def list_files(root: Path) -> list[str]:
    """Relative POSIX paths of the files and symlinks to deploy, sorted. Refuses a symlink that leaves the tree."""
    try:
        tracked = _git_files(root, "--cached")
        untracked = _git_files(root, "--others", "--exclude-standard")
    except (OSError, subprocess.CalledProcessError):
        tracked, untracked = [], _walk(root)
    files = set()
    made = outputs.listed(root)  # pulled runs and report files: dflashctl's own, never code
    untracked = [u for u in untracked if not _is_junk(u) and not outputs.is_output(u, made)]
    base = str(root)
    for rel in tracked + untracked:  # plain strings: thousands of Path objects cost a tenth of a second
        if rel.rsplit("/", 1)[-1] == MANIFEST_NAME:
            continue
        path = os.path.join(base, rel)
        try:
            mode = os.lstat(path).st_mode
        except OSError:  # tracked but deleted in the work tree
            continue
        if stat.S_ISLNK(mode):
            if not _inside(root, Path(path)):
                raise ConfigError(
                    path,
                    None,
                    f"symlink to {os.readlink(path)!r} leads outside the project; "
                    "deploy refuses to send what it points to",
                )
            files.add(rel)
        elif stat.S_ISREG(mode):  # a submodule (a directory) is not sent
            files.add(rel)
    return sorted(files)


def hash_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class HashCache:
    """sha256 of files keyed by (path, size, mtime_ns, inode, ctime_ns): unchanged files are not read again. Kept in
    the state dir (0600), one file per project root; a cache that cannot be read is simply rebuilt."""

    def __init__(self, root: Path) -> None:
        from dflashctl.model.record import state_dir

        key = hashlib.sha256(str(root.resolve()).encode("utf-8", "surrogateescape")).hexdigest()[:16]
        self.path = state_dir() / "hash-cache" / f"{key}.json"
        try:
            data = json.loads(self.path.read_text())
            self.entries: dict = data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            self.entries = {}
        self.fresh: dict = {}

    def sha256(self, rel: str, path: str | Path, st: os.stat_result) -> str:
        stamp = [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]
        hit = self.entries.get(rel)
        # a file changed within the same clock tick as its last hashing could keep its mtime: not trusted
        if isinstance(hit, list) and hit[:4] == stamp and time.time_ns() - st.st_mtime_ns > 2_000_000_000:
            self.fresh[rel] = hit
            return hit[4]
        digest = hash_file(path)
        self.fresh[rel] = [*stamp, digest]
        return digest

    def save(self) -> None:
        write_private_json(self.path, self.fresh)  # only a cache: a failed write is a slower next deploy


def build_manifest(root: Path, files: list[str] | None = None, cache: bool = True) -> Manifest:
    manifest: Manifest = {}
    hashes = HashCache(root) if cache else None
    base = str(root)
    for rel in files if files is not None else list_files(root):
        path = os.path.join(base, rel)
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(path).encode("utf-8", "surrogateescape")
            manifest[rel] = Entry(hashlib.sha256(target).hexdigest(), len(target), S_IFLNK | 0o777)
        else:
            digest = hashes.sha256(rel, path, st) if hashes else hash_file(path)
            manifest[rel] = Entry(digest, st.st_size, st.st_mode & 0o777)
    if hashes:
        hashes.save()
    return manifest


def manifest_version(manifest: Manifest) -> str:
    """A short content hash of the whole tree: equal trees give equal versions, whatever the host."""
    h = hashlib.sha256()
    for rel in sorted(manifest):
        e = manifest[rel]
        h.update(f"{rel}\0{e.sha256}\0{e.mode:o}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()[:16]


def manifest_to_json(manifest: Manifest) -> bytes:
    body = {"version": manifest_version(manifest), "files": {k: v.to_json() for k, v in sorted(manifest.items())}}
    return json.dumps(body, separators=(",", ":")).encode()


def _safe_relpath(rel: str) -> bool:
    p = PurePosixPath(rel)
    return bool(rel) and not p.is_absolute() and ".." not in p.parts and "\0" not in rel


def parse_remote_manifest(text: str) -> Manifest:
    """The remote's manifest; an unreadable or malformed one counts as empty (everything is sent again)."""
    try:
        files = json.loads(text)["files"]
        if not isinstance(files, dict):
            return {}
        return {
            k: Entry(str(v[0]), int(v[1]), int(v[2]))
            for k, v in files.items()
            if _safe_relpath(k) and isinstance(v, list) and len(v) == 3
        }
    except (ValueError, KeyError, TypeError, IndexError):
        return {}


@dataclass
class Plan:
    send: list[str]
    delete: list[str]


def plan_changes(local: Manifest, remote: Manifest) -> Plan:
    send = [rel for rel, e in local.items() if remote.get(rel) != e]
    delete = sorted(rel for rel in remote if rel not in local)
    return Plan(sorted(send), delete)


READ_STATE_SCRIPT = (
    WORKDIR_PRELUDE + 'printf "%s\\n" "$wd"; readlink -- "$wd/code" 2>/dev/null || echo; '
    'cat -- "$wd/code/$1" 2>/dev/null || true'
)


def read_remote_state(runner: Runner, workdir: str) -> tuple[str, str | None, Manifest]:
    """One remote command: the absolute workdir, the current release's version (None before the first release)
    and its manifest."""
    res = runner.run_script(READ_STATE_SCRIPT, workdir, MANIFEST_NAME).check("reading the remote manifest")
    first, _, rest = res.out.partition("\n")
    link, _, manifest = rest.partition("\n")
    link = link.strip()
    current = link.split("/", 1)[1] if link.startswith("releases/") and "/" not in link[9:] else None
    return first.strip(), current, parse_remote_manifest(manifest) if current else {}


def across_directories(files: list[str]) -> list[str]:
    """`files` reordered so that neighbours lie in different directories: one from each directory in turn. The agent
    creates files a few at a time, and creates in one directory wait for each other (the kernel locks the directory
    for each), while creates in different directories overlap."""
    by_dir: dict[str, list[str]] = {}
    for rel in files:
        by_dir.setdefault(rel.rpartition("/")[0], []).append(rel)
    groups = list(by_dir.values())
    return [rel for row in itertools.zip_longest(*groups) for rel in row if rel is not None]


def write_tar(out, root: Path, files: list[str], manifest: Manifest) -> None:
    """A tar stream of the changed files (symlinks as symlinks, neighbours in different directories) with the new
    manifest last, written to `out`."""
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT, bufsize=1 << 16) as tar:
        for rel in across_directories(files):
            path = root / rel
            if manifest[rel].mode & 0o170000 == S_IFLNK:
                info = tarfile.TarInfo(rel)
                info.type, info.linkname = tarfile.SYMTYPE, os.readlink(path)
                tar.addfile(info)
                continue
            info = tarfile.TarInfo(rel)
            info.size, info.mode, info.mtime = manifest[rel].size, manifest[rel].mode, int(path.lstat().st_mtime)
            with path.open("rb") as f:
                tar.addfile(info, f)
        body = manifest_to_json(manifest)
        info = tarfile.TarInfo(MANIFEST_NAME)
        info.size, info.mode, info.mtime = len(body), 0o644, int(time.time())
        tar.addfile(info, io.BytesIO(body))


def build_tar(root: Path, files: list[str], manifest: Manifest) -> tuple[tempfile.SpooledTemporaryFile, int]:
    """The tar of `write_tar` whole, in memory (or a temporary file when large); returns the stream and its size."""
    buf = tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY)
    write_tar(buf, root, files, manifest)
    size = buf.tell()
    buf.seek(0)
    return buf, size


class TarPipe:
    """The tar of `write_tar`, written by a thread into a pipe while the command reads the other end: the remote
    unpacks while this side is still reading files. `sent` counts the bytes; `close()` ends the writer (a command
    that stopped reading makes its writes fail) and raises what went wrong on this side (a file that vanished)."""

    def __init__(self, root: Path, files: list[str], manifest: Manifest) -> None:
        r, w = os.pipe()
        self._reader = os.fdopen(r, "rb")
        self._writer = os.fdopen(w, "wb")
        self.sent = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._write, args=(root, files, manifest), daemon=True)
        self._thread.start()

    def _write(self, root: Path, files: list[str], manifest: Manifest) -> None:
        try:
            with self._writer:
                write_tar(self, root, files, manifest)
        except BrokenPipeError:
            pass  # the command stopped reading: its own answer says why
        except OSError as e:  # a file gone or unreadable since it was hashed
            self.error = DflashError(
                f"{e.filename or root}: {e.strerror or e}: changed while deploying; nothing was switched, deploy again"
            )
        except BaseException as e:  # noqa: BLE001 - raised by close(), in the caller's thread
            self.error = e

    def write(self, data: bytes) -> int:
        self._writer.write(data)
        self.sent += len(data)
        return len(data)

    def read(self, n: int = -1) -> bytes:
        return self._reader.read(n)

    def close(self) -> None:
        self._reader.close()
        self._thread.join()
        if self.error is not None:
            raise self.error

    @staticmethod
    def estimate(files: list[str], manifest: Manifest) -> int:
        """About the stream's size, for a progress bar: the files' bytes and a header block each."""
        return sum(manifest[rel].size + 1024 for rel in files) + 1024 * (len(manifest) // 8 + 2)


ProgressFactory = Callable[[int], Callable[[int], None]]


class LastDeploy:
    """The release this machine last made current on one host and workdir, with its manifest: what lets the next
    deploy be one remote command. Kept in the state dir (0600), keyed by the whole host config and the workdir; one
    that cannot be read is simply not used."""

    def __init__(self, host, workdir: str) -> None:
        self.path = record_path(host, workdir)

    def read(self) -> tuple[str, str, Manifest, str | None] | None:
        """(absolute workdir, version, manifest, the interpreter the agent ran under), or None."""
        try:
            data = json.loads(self.path.read_text())
            files = {rel: Entry(str(e[0]), int(e[1]), int(e[2])) for rel, e in data["files"].items()}
            python = data.get("python")
            if isinstance(data["workdir"], str) and isinstance(data["version"], str):
                return data["workdir"], data["version"], files, python if isinstance(python, str) else None
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
            pass
        return None

    def write(self, abs_wd: str, version: str, manifest: Manifest, python: str | None = None) -> None:
        body = {
            "workdir": abs_wd,
            "version": version,
            "python": python,
            "files": {k: v.to_json() for k, v in manifest.items()},
        }
        write_private_json(self.path, body)  # unwritten: the next deploy reads the remote state instead


def deploy(
    runner: Runner,
    root: Path,
    workdir: str,
    *,
    dry_run: bool = False,
    progress: ProgressFactory | None = None,
) -> DeployReport:
    """Make the local tree at root the current release on the host (atomically, verified)."""
    start = time.monotonic()
    commands_before = runner.commands_run
    with ThreadPoolExecutor(1) as pool:  # the ssh handshake overlaps the hashing; no command runs before both are done
        opening = pool.submit(runner.connect)
        try:
            local = build_manifest(root)
        except BaseException:
            opening.exception()  # waited for, its own error dropped: a bad project is the first thing to fix
            raise
    opening.result()  # its failure (unreachable, host key) is raised once the local side has proven sound
    if not local:
        raise DflashError(f"{root}: no files to deploy")
    version = manifest_version(local)
    last = LastDeploy(runner.host, workdir)
    known = None if dry_run else last.read()
    report, travelled = None, 0
    agent = AgentPython(runner.host.python, (known[3] if known else None) or host_python(runner.host))
    if known is not None and known[1] != version:  # one remote command: the changes against what we last deployed
        abs_wd, base, base_files, _ = known
        plan = plan_changes(local, base_files)
        report = DeployReport.of(runner.host.name, abs_wd, version, plan)
        sent = _send_release(
            runner,
            root,
            local,
            plan.send,
            abs_wd,
            version,
            base,
            report=report,
            progress=progress,
            agent=agent,
            fallback=False,
        )
        if not sent:
            report, travelled = None, report.bytes_sent  # the base is gone from the remote: read its state, plan again
    if report is None and not dry_run and (known is None or known[1] != version):  # no usable record: one command
        report = _plan_and_send(runner, root, local, workdir, version, progress, agent)
        report.bytes_sent += travelled
    if report is None:
        abs_wd, current, remote = read_remote_state(runner, workdir)
        plan = plan_changes(local, remote) if current != version else Plan([], [])
        report = DeployReport.of(runner.host.name, abs_wd, version, plan, dry_run=dry_run, bytes_sent=travelled)
        if not dry_run and current != version:
            _send_release(
                runner,
                root,
                local,
                plan.send,
                abs_wd,
                version,
                current,
                report=report,
                progress=progress,
                agent=agent,
                fallback=True,
            )
    if not dry_run:
        last.write(report.code_dir.removesuffix("/code"), version, local, agent.resolved)
        remember_python(runner.host, agent.resolved)
    report.seconds = round(time.monotonic() - start, 3)
    report.remote_commands = runner.commands_run - commands_before
    return report


def _send_release(
    runner: Runner,
    root: Path,
    local: Manifest,
    send: list[str],
    abs_wd: str,
    version: str,
    base: str | None,
    *,
    report: DeployReport,
    progress: ProgressFactory | None,
    agent: AgentPython,
    fallback: bool,
) -> bool:
    """The agent's `release` with these files and `base` to link the rest from. When the base cannot serve (gone
    from the remote): with `fallback`, everything travels once more; without, False (the caller plans again)."""
    for _ in range(2):  # the second time, everything travels: the base release was not usable
        req = json.dumps({"workdir": abs_wd, "version": version, "base": base}, separators=(",", ":"))
        tick = progress(TarPipe.estimate(send, local) + len(AGENT)) if progress else None

        def attempt(python: str, req=req, send=send, tick=tick) -> Result:
            stream = TarPipe(root, send, local)
            try:
                return runner.run(
                    boot_argv(python, "release", req), stdin=_Concat(AGENT, stream), progress=tick, timeout=3600
                )
            finally:
                stream.close()
                report.bytes_sent += stream.sent

        res = agent.run(attempt)
        out, noise = split_answer(res.stdout)
        try:
            ans = json.loads(out)
            note_noise(runner.host.name, noise)
        except ValueError:
            detail = (res.err or res.out).strip()[-300:] or f"exit status {res.returncode}"
            raise RemoteCommandError(f"deploy to {runner.host.name} failed: {detail}") from None
        if ans.get("ok"):
            report.files_sent, report.sent = len(send), send
            agent.ran(ans.get("python"))
            return True
        if "need_full" not in str(ans.get("error")) or base is None:
            raise RemoteCommandError(
                f"deploy to {runner.host.name} failed, the previous release stays current: {ans.get('error')}"
            )
        if not fallback:
            return False
        send, base = sorted(local), None
    return False


def _plan_and_send(
    runner: Runner,
    root: Path,
    local: Manifest,
    workdir: str,
    version: str,
    progress: ProgressFactory | None,
    agent: AgentPython,
) -> DeployReport:
    """One command for a host this machine has no record of: the agent tells its current release (the plan step),
    this side answers on the same channel with the tar of what differs (or nothing: the tree is already current),
    and the agent links the rest from that release, verifies and switches, all under one hold of the deploy lock."""
    req = json.dumps({"workdir": workdir, "version": version, "plan": True}, separators=(",", ":"))
    talks: list[_PlanTalk] = []  # one an attempt: the last one's is what the agent told

    def attempt(python: str) -> Result:
        talk = _PlanTalk(root, local, version, progress)
        talks.append(talk)
        try:
            return runner.run(
                boot_argv(python, "release", req),
                stdin=_Concat(AGENT, talk),
                progress=talk.sent,
                heard=talk.hear,
                timeout=3600,
            )
        finally:
            talk.close()

    res = agent.run(attempt)
    talk = talks[-1]
    head, plan = talk.head, talk.plan
    try:
        ans = json.loads(res.stdout[talk.header_size :]) if head is not None else None
        note_noise(runner.host.name, bytes(talk.heard[: talk.noise_size]))
    except ValueError:
        ans = None
    if not isinstance(ans, dict) or head is None or plan is None:
        detail = (res.err or res.out).strip()[-300:] or f"exit status {res.returncode}"
        raise RemoteCommandError(f"deploy to {runner.host.name} failed: {detail}")
    abs_wd = str(head["workdir"])
    report = DeployReport.of(runner.host.name, abs_wd, version, plan, bytes_sent=talk.pipe.sent if talk.pipe else 0)
    if ans.get("ok"):
        agent.ran(ans.get("python"))
        return report
    if "need_full" not in str(ans.get("error")):
        raise RemoteCommandError(
            f"deploy to {runner.host.name} failed, the previous release stays current: {ans.get('error')}"
        )
    _send_release(
        runner,
        root,
        local,
        plan.send,
        abs_wd,
        version,
        None,
        report=report,
        progress=progress,
        agent=agent,
        fallback=True,
    )
    return report


MAX_NOISE = 64 << 10  # what a banner may print before the agent's header; past it, it is not a banner


class _PlanTalk:
    """The plan step's stdin after the agent's source: once the agent has told its current release (heard on its
    stdout: a header line, then that release's manifest), the tar of what differs, or nothing."""

    def __init__(self, root: Path, local: Manifest, version: str, progress: ProgressFactory | None) -> None:
        self.root, self.local, self.version, self.progress = root, local, version, progress
        self.heard = bytearray()
        self.ready = threading.Event()
        self.head: dict | None = None  # the header line, once it parsed
        self.header_size = 0  # the header line and the manifest after it: where the agent's answer starts
        self.noise_size = 0  # lines a `python:` wrapper printed before the agent's header
        self.plan: Plan | None = None
        self.pipe: TarPipe | None = None
        self.tail = None
        self.tick = None

    def hear(self, data: bytes) -> None:
        if self.ready.is_set():
            return
        if not data:  # the command ended before it told anything: the answer is its error
            self.ready.set()
            return
        self.heard += data
        while self.head is None:
            line, sep, _ = self.heard[self.noise_size :].partition(b"\n")
            if not sep:
                return
            try:
                head = json.loads(line)
                self.header_size = self.noise_size + len(line) + 1 + int(head["manifest_bytes"])
                self.head = head
            except (ValueError, KeyError, TypeError):
                if line.startswith(b"{") or self.noise_size > MAX_NOISE:  # not the agent talking: end its input
                    self.ready.set()
                    return
                self.noise_size += len(line) + 1  # a banner before the agent's header: skipped, named later
        if len(self.heard) >= self.header_size:
            self.ready.set()

    def _answer(self) -> object:
        if self.head is None or len(self.heard) < self.header_size:
            self.head = None
            return io.BytesIO(b"")  # the agent said nothing usable: end its input; its exit says what went wrong
        current = self.head.get("current")
        line_end = self.heard.index(b"\n", self.noise_size) + 1
        manifest = bytes(self.heard[line_end : self.header_size]).decode("utf-8", "replace")
        remote = parse_remote_manifest(manifest) if current else {}
        self.plan = plan_changes(self.local, remote) if current != self.version else Plan([], [])
        if current == self.version:
            return io.BytesIO(b"")  # already the current release: an empty stdin says so
        self.tick = self.progress(TarPipe.estimate(self.plan.send, self.local)) if self.progress else None
        self.pipe = TarPipe(self.root, self.plan.send, self.local)
        return self.pipe

    def read(self, n: int = -1) -> bytes:
        if self.tail is None:
            self.ready.wait()
            self.tail = self._answer()
        return self.tail.read(n)

    def sent(self, n: int) -> None:
        if self.tick:
            self.tick(n)

    def close(self) -> None:
        if self.pipe is not None:
            self.pipe.close()


class _Concat:
    """A file-like stream of bytes followed by another stream (the agent's source, then the tar)."""

    def __init__(self, head: bytes, tail) -> None:
        self.head, self.tail = head, tail

    def read(self, n: int = -1) -> bytes:
        if self.head:
            out, self.head = self.head[:n] if n >= 0 else self.head, self.head[n:] if n >= 0 else b""
            return out
        return self.tail.read(n)
