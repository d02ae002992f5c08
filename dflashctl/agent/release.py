"""Runs ON the remote, stdlib only: turns a tar of changed files into a verified, immutable release of the code.

Invoked like the probe (`python3 -c BOOT LEN REQUEST_JSON`, this source then the tar on stdin). Under a lock on the
workdir (`.deploy.lock`), it stages `releases/.staging-<version>-<pid>/`: the tar's files are written there, the
unchanged ones hard-linked from the base release, then every file's hash, size, mode and every symlink's target is
checked against the manifest (the tar's last member) and nothing else may be there. Only then is the staging dir
renamed to `releases/<version>/` and `code` (a symlink) switched to it with one rename. Any failure (a full disk, a
killed connection, a corrupt stream) leaves the previous release current and intact; the next deploy removes the
leftover staging dir. Releases that no live job uses are collected, keeping the newest few: after the answer, by a
detached child holding the lock.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import queue
import shutil
import stat
import sys
import tarfile
import threading
import time

from .common import locked, read_int, read_json, write_all

MANIFEST_NAME = ".dflashctl-manifest.json"
KEEP_RELEASES = 3  # besides the current one and those live jobs use
S_IFLNK = 0o120000


class ReleaseError(Exception):
    pass


def _safe(rel: str) -> bool:
    parts = rel.split("/")
    return bool(rel) and not rel.startswith("/") and ".." not in parts and "" not in parts and "\0" not in rel


def _release_name(name: object) -> bool:
    """A release's directory name under `releases/`: one safe path part."""
    return isinstance(name, str) and _safe(name) and "/" not in name


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _makedirs(path: str, made: set[str]) -> None:
    """os.makedirs of a file's directory, once per directory (a release of thousands of files has few)."""
    parent = os.path.dirname(path)
    if parent not in made:
        os.makedirs(parent, exist_ok=True)
        made.add(parent)


WRITERS = 4  # files created at once
QUEUED = 16  # files read from the stream and not yet written, at most
WRITTEN_BY_READER = 4 << 20  # a file larger than this is written by the reading thread as it streams, never held


def _write_file(path: str, blocks, mode: int, umask: int) -> str:
    """Create `path` (never through a symlink, never over a file) with `blocks`' bytes and `mode`; returns their
    sha256. The mode is given at creation; a chmod follows only for the bits the umask took away."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode & 0o777)
    h = hashlib.sha256()
    try:
        for block in blocks:
            h.update(block)
            write_all(fd, block)
        if mode & 0o777 & umask:
            os.fchmod(fd, mode & 0o777)
    finally:
        os.close(fd)
    return h.hexdigest()


class _Writers:
    """A few threads that create and write the stream's files while one thread reads the stream in order. Creating a
    file is what a release of many small files waits on (a journal's inode, 0.1 to 1 ms on some disks; a round trip
    on NFS or Lustre), and creates overlap: on a 2-core machine four writers stage 2,000 files in about half the time
    of one. At most QUEUED files wait in memory, each at most WRITTEN_BY_READER bytes."""

    def __init__(self, umask: int) -> None:
        self.umask = umask
        self.digests: dict[str, str] = {}
        self.error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue(QUEUED)
        self._threads = [threading.Thread(target=self._work, daemon=True) for _ in range(WRITERS)]
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self.error is not None:
                continue  # after a failure the rest is dropped: the release fails as a whole
            name, path, data, mode = item
            try:
                self.digests[name] = _write_file(path, (data,), mode, self.umask)
            except BaseException as e:  # noqa: BLE001 - raised in the reading thread by put() or close()
                self.error = self.error or e

    def put(self, name: str, path: str, data: bytes, mode: int) -> None:
        if self.error is not None:
            raise self.error
        self._queue.put((name, path, data, mode))

    def close(self) -> None:
        """Every queued file written (or dropped after a failure) and every writer gone: nothing writes into the
        staging dir after this returns, so the caller may remove it."""
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()


def _current_umask() -> int:
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def extract(stream, staging: str, written: dict[str, str | None], made: set[str]) -> bytes:
    """Write the tar's regular files and symlinks into staging (symlinks last, so no file is written through one),
    recording each path in `written` with the sha256 of the bytes written (None for a symlink): verification then
    needs no second read. Returns the manifest's bytes."""
    manifest = None
    links = []
    umask = _current_umask()
    writers = _Writers(umask)
    try:
        with tarfile.open(fileobj=stream, mode="r|", bufsize=1 << 16) as tar:
            for m in tar:
                if not _safe(m.name):
                    raise ReleaseError(f"unsafe path in the stream: {m.name!r}")
                if m.name == MANIFEST_NAME:
                    manifest = tar.extractfile(m).read()
                    continue
                if m.issym():
                    links.append((m.name, m.linkname))
                    continue
                if not m.isreg():
                    raise ReleaseError(f"unexpected member type in the stream: {m.name!r}")
                path = os.path.join(staging, m.name)
                _makedirs(path, made)
                src = tar.extractfile(m)
                if m.size <= WRITTEN_BY_READER:
                    writers.put(m.name, path, src.read(), m.mode)
                else:
                    written[m.name] = _write_file(path, iter(functools.partial(src.read, 1 << 20), b""), m.mode, umask)
    finally:
        writers.close()
    if writers.error is not None:
        raise writers.error
    written.update(writers.digests)
    for name, target in links:
        written[name] = None
        path = os.path.join(staging, name)
        _makedirs(path, made)
        os.symlink(target, path)
    if manifest is None:
        raise ReleaseError("the stream ended before its manifest (interrupted or corrupt)")
    return manifest


FSYNC_EACH_UP_TO = 64  # written files fsynced one by one up to this many; more: one syncfs(2) of the filesystem


def make_durable(staging: str, written) -> None:
    """What this release wrote reaches the disk before `code` points at it: the files the stream carried (one fsync
    each when few; one syncfs(2) when many, rather than thousands of fsyncs) and every directory entry (the hard
    links included). Files linked from the base release were made durable by its own deploy."""
    if len(written) <= FSYNC_EACH_UP_TO:
        for rel in written:
            path = os.path.join(staging, rel)
            if os.path.islink(path):
                continue  # a symlink's target text lives in its directory entry, synced below
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    else:
        import ctypes

        fd = os.open(staging, os.O_RDONLY)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if getattr(libc, "syncfs", None) is None or libc.syncfs(fd) != 0:
                os.sync()
        finally:
            os.close(fd)
    for dirpath, _, _ in os.walk(staging):
        _fsync_dir(dirpath)


def link_unchanged(files: dict, staging: str, base_dir: str | None, written, made: set[str]) -> set[str]:
    """Hard-link every manifest entry the stream did not carry from the base release (immutable: sharing inodes
    with it is safe). Returns the linked paths."""
    linked: set[str] = set()
    for rel in files:
        if rel in written:
            continue
        if base_dir is None:
            raise ReleaseError(f"need_full: {rel!r} was not sent and there is no base release")
        dst = os.path.join(staging, rel)
        _makedirs(dst, made)
        try:
            os.link(os.path.join(base_dir, rel), dst, follow_symlinks=False)
        except OSError as e:
            raise ReleaseError(f"need_full: cannot link {rel!r} from the base release: {e.strerror}") from None
        linked.add(rel)
    return linked


def _sha_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify(root: str, files: dict, linked: frozenset[str] = frozenset(), written: dict | None = None) -> list[str]:
    """Every manifest entry is there with its hash, size and mode (symlinks: their target), and nothing else was
    written. A file hard-linked from the base release is that release's verified file (link(2) made it the same
    inode), so it is not read again; a file the stream carried is checked against the hash of the bytes written to
    it (`written`: path -> sha256). `written=None` (an existing release checked for reuse): every file is read and
    hashed, and the tree is walked for strays."""
    problems = []
    for rel, (sha, size, mode) in files.items():
        if rel in linked:
            continue
        path = os.path.join(root, rel)
        try:
            st = os.lstat(path)
        except OSError:
            problems.append(f"missing: {rel}")
            continue
        if mode & 0o170000 == S_IFLNK:
            target = os.readlink(path).encode("utf-8", "surrogateescape") if stat.S_ISLNK(st.st_mode) else None
            if target is None or hashlib.sha256(target).hexdigest() != sha:
                problems.append(f"wrong symlink: {rel}")
            continue
        digest = written.get(rel) if written is not None else None
        if not stat.S_ISREG(st.st_mode) or st.st_size != size or (digest or _sha_file(path)) != sha:
            problems.append(f"wrong content: {rel}")
        elif st.st_mode & 0o777 != mode & 0o777:
            problems.append(f"wrong mode: {rel}")
    if written is None:
        written = {}
        for dirpath, dirnames, filenames in os.walk(root):
            rel_dir = os.path.relpath(dirpath, root)
            for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
                written[name if rel_dir == "." else f"{rel_dir}/{name}"] = None
        written.pop(MANIFEST_NAME, None)
    problems += [f"unexpected: {rel}" for rel in sorted(set(written) - set(files))]
    return problems


def in_use(wd: str) -> set[str]:
    """Releases that a job may still run from: any run without a stop result that did not finish with exit 0 (a
    crashed job may be restarted from its release)."""
    used = set()
    runs = os.path.join(wd, "runs")
    for name in os.listdir(runs) if os.path.isdir(runs) else []:
        run = os.path.join(runs, name)
        meta = read_json(os.path.join(run, "job.json"))
        if not isinstance(meta, dict):
            continue
        release = meta.get("release")
        finished = read_int(os.path.join(run, "exit_code")) == 0
        if isinstance(release, str) and not finished and not os.path.exists(os.path.join(run, "stop_result")):
            used.add(release)
    return used


def collect(wd: str, current: str) -> list[str]:
    releases = os.path.join(wd, "releases")
    keep = in_use(wd) | {current}
    found = [d for d in os.listdir(releases) if not d.startswith(".")]
    found.sort(key=lambda d: os.lstat(os.path.join(releases, d)).st_mtime, reverse=True)
    removed = []
    for d in found[KEEP_RELEASES:]:
        if d not in keep:
            shutil.rmtree(os.path.join(releases, d), ignore_errors=True)
            removed.append(d)
    return removed


def switch(wd: str, version: str) -> None:
    code = os.path.join(wd, "code")
    if os.path.isdir(code) and not os.path.islink(code):  # a tree from before releases: keep it as one
        os.rename(code, os.path.join(wd, "releases", f"legacy-{int(time.time())}"))
    tmp = os.path.join(wd, f".code.tmp{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    os.symlink(f"releases/{version}", tmp)
    os.replace(tmp, code)
    _fsync_dir(wd)


def parse_manifest(raw: bytes) -> tuple[str, dict]:
    body = json.loads(raw)
    files = body.get("files") if isinstance(body, dict) else None
    if not isinstance(files, dict) or not isinstance(body.get("version"), str):
        raise ReleaseError("malformed manifest in the stream")
    out = {}
    for rel, entry in files.items():
        if not _safe(rel) or not isinstance(entry, list) or len(entry) != 3:
            raise ReleaseError(f"malformed manifest entry: {rel!r}")
        out[rel] = (str(entry[0]), int(entry[1]), int(entry[2]))
    return body["version"], out


def release(req: dict, stream) -> dict:
    """Stage, verify and switch to the release; the caller holds the deploy lock."""
    t0 = time.monotonic()
    wd = req["workdir"]
    releases = os.path.join(wd, "releases")
    for d in os.listdir(releases):
        if d.startswith(".staging-"):
            shutil.rmtree(os.path.join(releases, d), ignore_errors=True)
    version = req["version"]
    if not _release_name(version):
        raise ReleaseError(f"bad version {version!r}")
    final = os.path.join(releases, version)
    base = req.get("base")
    base_dir = os.path.join(releases, base) if _release_name(base) else None
    staging = os.path.join(releases, f".staging-{version}-{os.getpid()}")
    os.mkdir(staging, 0o755)
    try:
        written: dict[str, str | None] = {}
        made: set[str] = {staging}
        got_version, files = parse_manifest(extract(stream, staging, written, made))
        if got_version != version:
            raise ReleaseError(f"the stream is version {got_version}, expected {version}")
        if os.path.isdir(final) and not verify(final, files):  # already deployed and intact: reuse it
            shutil.rmtree(staging)
            switch(wd, version)
            return {"ok": True, "reused": True, "linked": 0, "verified": len(files), "python": sys.executable}
        base_ok = base_dir if base_dir and os.path.isdir(base_dir) else None
        linked = link_unchanged(files, staging, base_ok, written, made)
        with open(os.path.join(staging, MANIFEST_NAME), "w") as f:  # dumps: the C encoder, dump streams in Python
            f.write(json.dumps({"version": version, "files": {k: list(v) for k, v in files.items()}}))
        problems = verify(staging, files, frozenset(linked), written)
        if problems:
            raise ReleaseError(f"verification failed ({len(problems)}): {'; '.join(problems[:5])}")
        t_verified = time.monotonic()
        make_durable(staging, written)
        if os.path.isdir(final):  # a broken leftover of the same version: replaced, never trusted
            shutil.rmtree(final)
        os.rename(staging, final)
        _fsync_dir(releases)
        switch(wd, version)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    seconds = {"stage_and_verify": t_verified - t0, "durable_and_switch": time.monotonic() - t_verified}
    return {
        "ok": True,
        "reused": False,
        "linked": len(linked),
        "verified": len(files),
        "python": sys.executable,
        "seconds": {k: round(v, 3) for k, v in seconds.items()},
    }


def collect_after_answer(wd: str, version: str) -> None:
    """Old releases are removed after the answer is out: a child process, in a session of its own with no tie to the
    command's output, deletes them while the deploy already returns (thousands of files take a tenth of a second).
    Called under the deploy lock, whose open file the child inherits: the lock stays held until the collection is
    done, so the next deploy waits for it. Where fork fails, they are removed now."""
    try:
        pid = os.fork()
    except OSError:
        collect(wd, version)
        return
    if pid:
        return
    try:  # the child: never returns into the caller's code
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        collect(wd, version)
    except BaseException:  # noqa: BLE001 - nobody to tell; the next deploy collects again
        pass
    finally:
        os._exit(0)


def current_release(wd: str) -> str | None:
    """The version `code` points to, or None (no release yet, or a tree from before releases)."""
    try:
        link = os.readlink(os.path.join(wd, "code"))
    except OSError:
        return None
    version = link[len("releases/") :] if link.startswith("releases/") else ""
    return version if _release_name(version) else None


def tell_current(wd: str, out) -> str | None:
    """The plan step, for a client with no record of this host: one header line (the absolute workdir, the current
    release, the size of its manifest), then that manifest's bytes. The client answers with the tar of what differs,
    or with nothing (an empty stdin) when the current release is already its tree. Returns the current version."""
    current = current_release(wd)
    manifest = b""
    if current:
        path = os.path.join(wd, "releases", current, MANIFEST_NAME)
        with contextlib.suppress(OSError), open(path, "rb") as f:  # unreadable: empty, and everything travels
            manifest = f.read()
    head = {"workdir": wd, "current": current, "manifest_bytes": len(manifest)}
    out.write(json.dumps(head).encode() + b"\n" + manifest)
    out.flush()
    return current


def main() -> int:
    req = json.loads(sys.argv[1])
    wd = req["workdir"]
    if wd == "~" or wd.startswith("~/"):  # as the shell would: the workdir arrives as a value, never expanded
        wd = req["workdir"] = os.path.expanduser(wd)
    try:
        os.makedirs(os.path.join(wd, "releases"), exist_ok=True)
        with locked(os.path.join(wd, ".deploy.lock"), timeout=600.0, held_by="another deploy"):
            stdin = sys.stdin.buffer
            if req.get("plan"):
                req["base"] = tell_current(wd, sys.stdout.buffer)
                if not stdin.peek(1):  # the client's tree is the current release: nothing to do
                    sys.stdout.write(json.dumps({"ok": True, "unchanged": True, "python": sys.executable}))
                    return 0
            answer = release(req, stdin)
            sys.stdout.write(json.dumps(answer))
            sys.stdout.flush()
            collect_after_answer(wd, req["version"])
        return 0
    except (ReleaseError, OSError, tarfile.TarError, ValueError, EOFError) as e:
        if isinstance(e, OSError) and e.strerror:  # a full disk's ENOSPC may name no file: never ": None"
            detail = f"{e.strerror}: {e.filename}" if e.filename else e.strerror
        else:
            detail = str(e)
        sys.stdout.write(json.dumps({"ok": False, "error": f"{type(e).__name__}: {detail}"}))
        return 1


if __name__ == "__main__":
    sys.exit(main())
