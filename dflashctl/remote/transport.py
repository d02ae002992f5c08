"""Run a command on a host: one interface, a local and an ssh runner, each optionally inside a container.

Commands are argument lists. Each layer quotes them once: the container prefix (`pct exec CTID --`,
`docker exec -i NAME`) is prepended as arguments, and the ssh runner joins the whole list with shlex for the remote
login shell. Shell features are asked for explicitly with `run_script`, which passes the script to `bash -c` and the
values as positional arguments, so no value is ever pasted into a script.
"""

from __future__ import annotations

import contextlib
import os
import select
import shlex
import subprocess
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import BinaryIO

from dflashctl.config import HostConfig
from dflashctl.errors import RemoteCommandError

Progress = Callable[[int], None]
Heard = Callable[[bytes], None]  # each chunk of a command's stdout as it arrives, then b"" at its end
CHUNK = 256 * 1024

# ssh client settings, one reason each.
MAX_OUTPUT_CAPTURED = 64 << 20  # a runaway command must not take all our memory: the rest is read and dropped
AFTER_TIMEOUT_S = 2.0  # a timed-out command's output still in flight: read this long more, then return without it


@dataclass
class Result:
    """What a finished remote command gave back. `returncode` is the remote process's own exit status."""

    argv: list[str]
    returncode: int
    stdout: bytes
    stderr: bytes

    @property
    def out(self) -> str:
        return self.stdout.decode("utf-8", "replace")

    @property
    def err(self) -> str:
        return self.stderr.decode("utf-8", "replace")

    def check(self, what: str) -> Result:
        if self.returncode != 0:
            detail = self.err.strip().splitlines()[-1:] or [f"exit status {self.returncode}"]
            raise RemoteCommandError(f"{what} failed (exit {self.returncode}): {detail[0]}")
        return self


# Prepended to remote scripts that take the workdir as $1: expands a leading `~/` to the remote $HOME (values
# passed as arguments are never tilde-expanded by a shell) and exports it as $wd.
WORKDIR_PRELUDE = 'wd="$1"; case "$wd" in "~") wd="$HOME";; "~/"*) wd="$HOME/${wd#"~/"}";; esac; shift; '


def container_prefix(host: HostConfig) -> list[str]:
    """The arguments that run a command inside the host's container, or nothing."""
    if host.container_kind == "pct":
        return ["pct", "exec", str(host.container_id), "--"]
    if host.container_kind == "docker":
        return ["docker", "exec", "-i", str(host.container_id)]
    return []


def _chunks(stdin: bytes | BinaryIO | None) -> list[bytes] | BinaryIO | None:
    if isinstance(stdin, bytes):
        return [stdin[i : i + CHUNK] for i in range(0, len(stdin), CHUNK)]
    return stdin


class UserStdin:
    """A user's own stdin passed through (`exec`), fed from a thread of its own, so that a command that ends without
    reading it all is not kept waiting on a pipe that never closes.

    The thread reads the file descriptor itself (poll, then os.read), never through `sys.stdin.buffer`: a thread
    blocked inside that buffered reader holds its lock, and the interpreter's exit, which closes the standard
    streams, then aborts the process ("_enter_buffered_busy: could not acquire lock for <stdin>", exit 134) however
    the command ended. `stop()` (or leaving the `with`) wakes the thread and waits for it, so none is reading when
    the command's exit status is returned."""

    JOIN_S = 2.0  # a thread still writing after this is stuck in a pipe a leftover process holds: left, lock-free

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream
        self._wake_r, self._wake_w = os.pipe()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def start(self, write: Callable[[bytes], object], close: Callable[[], object], progress: Progress | None) -> None:
        self._thread = threading.Thread(
            target=self._pump, args=(write, close, progress), daemon=True, name="dflashctl-stdin"
        )
        self._thread.start()

    def stop(self) -> None:
        """The command has ended: wake the thread from its wait for input and wait for it to end (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(self.JOIN_S)
        if self._thread is None or not self._thread.is_alive():  # else it may still poll them: leave both open
            os.close(self._wake_r)
            os.close(self._wake_w)

    def __enter__(self) -> UserStdin:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _chunks(self) -> Iterator[bytes]:
        try:
            fd = self.stream.fileno()
        except (AttributeError, OSError, ValueError):  # an in-memory stream: nothing to poll, read it as it is
            yield from iter(lambda: self.stream.read(CHUNK), b"")
            return
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while True:
            ready = {f for f, _ in poller.poll()}
            if self._wake_r in ready:
                return
            try:
                chunk = os.read(fd, CHUNK)  # POLLHUP or POLLERR also wake us: the read says which (EOF, an error)
            except BlockingIOError:  # someone else made the descriptor non-blocking: wait for data again
                continue
            if not chunk:
                return
            yield chunk

    def _pump(self, write: Callable[[bytes], object], close: Callable[[], object], progress: Progress | None) -> None:
        try:
            for chunk in self._chunks():
                write(chunk)
                if progress:
                    progress(len(chunk))
        except OSError:
            pass  # the command exited without reading all of it, or stdin failed: its exit status says why
        finally:
            with contextlib.suppress(Exception):  # the channel may be gone with the command: nothing left to tell
                close()


def feed(write: Callable[[bytes], object], close: Callable[[], object], stdin, progress: Progress | None) -> None:
    if isinstance(stdin, UserStdin):
        stdin.start(write, close, progress)
    else:
        _feed(write, close, stdin, progress)


def fd_writer(fd: int) -> Callable[[bytes], None]:
    """Write all of each chunk to a descriptor with no buffered object's lock held while it blocks."""

    def write(chunk: bytes) -> None:
        view = memoryview(chunk)
        while view:
            view = view[os.write(fd, view) :]

    return write


def _feed(write: Callable[[bytes], object], close: Callable[[], object], stdin, progress: Progress | None) -> None:
    """Stream stdin to the command in chunks, reporting bytes sent, then close its input."""
    try:
        source = _chunks(stdin)
        if source is not None:
            it = source if isinstance(source, list) else iter(lambda: source.read(CHUNK), b"")
            for chunk in it:
                write(chunk)
                if progress:
                    progress(len(chunk))
    except (BrokenPipeError, OSError):
        pass  # the command exited without reading all of it; its exit status says why
    finally:
        try:
            close()
        except OSError:
            pass


class Runner(ABC):
    """Runs argument lists on one host. One connection per runner; `close()` when done."""

    def __init__(self, host: HostConfig) -> None:
        self.host = host
        self.commands_run = 0

    def command_for(self, argv: Sequence[str], on_host: bool = False) -> list[str]:
        """The full argument list as executed on the host: container prefix (unless on_host) + argv."""
        prefix = [] if on_host else container_prefix(self.host)
        return [*prefix, *argv]

    def run(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | BinaryIO | None = None,
        on_host: bool = False,
        timeout: float | None = None,
        progress: Progress | None = None,
        heard: Heard | None = None,
    ) -> Result:
        """Run argv (inside the container unless on_host) and wait for it. Never raises on a non-zero exit.
        `heard` sees the stdout as it comes, so that a `stdin` stream can answer what the command said first."""
        full = self.command_for(argv, on_host)
        self.commands_run += 1
        return self._exec(full, stdin, timeout, progress, heard)

    def run_script(self, script: str, *args: str, **kwargs) -> Result:
        """Run a bash script with args as $1..$N: the script is constant, the values never enter it as text."""
        return self.run(["bash", "--noprofile", "--norc", "-c", script, "dflashctl", *args], **kwargs)

    def describe(self, argv: Sequence[str], on_host: bool = False) -> str:
        """What `run` would execute, as one printable line (for --dry-run)."""
        return shlex.join(self.command_for(argv, on_host))

    @abstractmethod
    def _exec(
        self, argv: list[str], stdin, timeout: float | None, progress: Progress | None, heard: Heard | None
    ) -> Result: ...

    def connect(self) -> None:  # noqa: B027 - optional hook
        """Open the connection now, running nothing on the host (ssh: the handshake and authentication), so that a
        caller with local work to do first can overlap the two. The first command opens it otherwise."""

    def check_connection(self) -> None:
        """Raise UnreachableError/HostKeyError if the host (and its container) cannot run a command."""
        self.run(["true"]).check("running `true` on the host")

    def close(self) -> None:  # noqa: B027 - optional hook
        pass

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LocalRunner(Runner):
    """This machine, through subprocess: no shell unless the command asks for one."""

    def _exec(self, argv, stdin, timeout, progress, heard=None) -> Result:
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        except FileNotFoundError as e:
            return Result(argv, 127, b"", f"{e.filename}: command not found\n".encode())
        out, err = bytearray(), bytearray()

        def drain(stream, sink: bytearray, hear: Heard | None) -> None:
            fd = stream.fileno()  # read raw: a reader left blocked (below) holds no buffered object's lock
            try:
                for block in iter(lambda: os.read(fd, CHUNK), b""):
                    if hear:
                        hear(block)
                    if len(sink) < MAX_OUTPUT_CAPTURED:
                        sink.extend(block[: MAX_OUTPUT_CAPTURED - len(sink)])
            except OSError:
                pass
            finally:
                if hear:
                    hear(b"")

        readers = [
            threading.Thread(target=drain, args=(proc.stdout, out, heard), daemon=True),
            threading.Thread(target=drain, args=(proc.stderr, err, None), daemon=True),
        ]
        for t in readers:
            t.start()
        if isinstance(stdin, UserStdin):  # fed from its own thread: a raw write holds no lock while it blocks
            feed(fd_writer(proc.stdin.fileno()), proc.stdin.close, stdin, progress)
        elif stdin is not None:
            feed(proc.stdin.write, proc.stdin.close, stdin, progress)
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            proc.wait()
        for t in readers:  # after a timeout, a process the command left may hold its output open: not waited for
            t.join(AFTER_TIMEOUT_S if timed_out else None)
        if isinstance(stdin, UserStdin):
            stdin.stop()
        if timed_out:
            return Result(argv, 124, bytes(out), bytes(err) + b"dflashctl: command timed out\n")
        return Result(argv, proc.returncode, bytes(out), bytes(err))
