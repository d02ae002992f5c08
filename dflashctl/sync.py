"""deploy: which files travel, what changed, and how they get there.

The files are those git tracks plus untracked files git does not ignore (outside a git checkout: everything but
common junk). Each file's sha256 goes into a manifest; the remote keeps the manifest of what it last received in
`<workdir>/code/.dflashctl-manifest.json`. A deploy is then:
  1. one remote command that prints the remote workdir and manifest,
  2. if anything changed, one remote command that unpacks a tar of the changed files (the new manifest last, so an
     interrupted deploy is simply resent) and removes the files deleted locally.
The manifest's hash is the code version that launches record.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

from dflashctl.errors import DflashError, RemoteCommandError
from dflashctl.transport import WORKDIR_PRELUDE, Runner

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

    def to_dict(self) -> dict:
        return asdict(self)


def _is_junk(rel: PurePosixPath) -> bool:
    return (
        any(part in JUNK_DIRS or part.endswith(".egg-info") for part in rel.parts[:-1])
        or rel.name in JUNK_FILES
        or rel.name.endswith(JUNK_SUFFIXES)
    )


def list_files(root: Path) -> list[str]:
    """Relative POSIX paths of the files to deploy, sorted. Regular files only (symlinks are followed)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
            check=True,
        ).stdout.decode("utf-8", "surrogateescape")
        candidates = [p for p in out.split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        candidates = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in JUNK_DIRS and not d.endswith(".egg-info")]
            rel_dir = Path(dirpath).relative_to(root)
            candidates += [(rel_dir / f).as_posix() for f in filenames]
    files = []
    for rel in candidates:
        rp = PurePosixPath(rel)
        if rp.name == MANIFEST_NAME or _is_junk(rp):
            continue
        if (root / rel).is_file():  # tracked but deleted in the work tree, or a submodule: not sent
            files.append(rp.as_posix())
    return sorted(set(files))


def hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build_manifest(root: Path, files: list[str] | None = None) -> Manifest:
    manifest: Manifest = {}
    for rel in files if files is not None else list_files(root):
        p = root / rel
        st = p.stat()
        manifest[rel] = Entry(hash_file(p), st.st_size, st.st_mode & 0o777)
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
    """The remote's manifest; an unreadable one counts as empty (everything is sent again)."""
    try:
        files = json.loads(text)["files"]
        return {k: Entry(v[0], int(v[1]), int(v[2])) for k, v in files.items() if _safe_relpath(k)}
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


READ_STATE_SCRIPT = WORKDIR_PRELUDE + 'printf "%s\\n" "$wd"; cat -- "$wd/code/$1" 2>/dev/null || true'

APPLY_SCRIPT = (
    WORKDIR_PRELUDE
    + 'mkdir -p -- "$wd/code" && cd -- "$wd/code" || exit 1\n'
    + "tar -x --no-same-owner -f - || exit 1\n"
    + 'for f in "$@"; do rm -f -- "$f"; d=$(dirname -- "$f"); '
    + 'while [ "$d" != . ] && rmdir -- "$d" 2>/dev/null; do d=$(dirname -- "$d"); done; done\n'
)


def read_remote_state(runner: Runner, workdir: str) -> tuple[str, Manifest]:
    """One remote command: the absolute workdir and the manifest of the code deployed there."""
    res = runner.run_script(READ_STATE_SCRIPT, workdir, MANIFEST_NAME).check("reading the remote manifest")
    first, _, rest = res.out.partition("\n")
    return first.strip(), parse_remote_manifest(rest)


def build_tar(root: Path, files: list[str], manifest: Manifest) -> tuple[tempfile.SpooledTemporaryFile, int]:
    """A tar of the changed files with the new manifest last; returns the stream and its size."""
    buf = tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY)
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in files:
            info = tar.gettarinfo(str(root / rel), arcname=rel)
            if info.issym() or info.islnk():  # send what the link points to
                data = (root / rel).read_bytes()
                info = tarfile.TarInfo(rel)
                info.size, info.mode = len(data), manifest[rel].mode
                tar.addfile(info, io.BytesIO(data))
                continue
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with (root / rel).open("rb") as f:
                tar.addfile(info, f)
        body = manifest_to_json(manifest)
        info = tarfile.TarInfo(MANIFEST_NAME)
        info.size, info.mode, info.mtime = len(body), 0o644, int(time.time())
        tar.addfile(info, io.BytesIO(body))
    size = buf.tell()
    buf.seek(0)
    return buf, size


ProgressFactory = Callable[[int], Callable[[int], None]]


def deploy(
    runner: Runner,
    root: Path,
    workdir: str,
    *,
    dry_run: bool = False,
    progress: ProgressFactory | None = None,
) -> DeployReport:
    """Bring <workdir>/code on the host to the state of the local tree at root."""
    start = time.monotonic()
    commands_before = runner.commands_run
    local = build_manifest(root)
    if not local:
        raise DflashError(f"{root}: no files to deploy")
    abs_wd, remote = read_remote_state(runner, workdir)
    plan = plan_changes(local, remote)
    report = DeployReport(
        host=runner.host.name,
        code_dir=f"{abs_wd}/code",
        version=manifest_version(local),
        files_sent=len(plan.send),
        files_deleted=len(plan.delete),
        dry_run=dry_run,
        sent=plan.send,
        deleted=plan.delete,
    )
    if not dry_run and (plan.send or plan.delete):
        stream, size = build_tar(root, plan.send, local)
        with stream:
            tick = progress(size) if progress else None
            res = runner.run_script(APPLY_SCRIPT, workdir, *plan.delete, stdin=stream, progress=tick)
        if res.returncode != 0:
            raise RemoteCommandError(f"deploy to {runner.host.name}: unpacking failed: {res.err.strip()[-300:]}")
        report.bytes_sent = size
    report.seconds = round(time.monotonic() - start, 3)
    report.remote_commands = runner.commands_run - commands_before
    return report
