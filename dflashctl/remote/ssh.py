"""The ssh runner: paramiko, with the destination resolved as the user's own `ssh` resolves it (`ssh -G`), host keys
checked like OpenSSH (`@revoked` refused, unknown keys refused unless accepted), one connection per runner.

Kept apart from dflashctl.remote.transport so that commands on the `local` host never import paramiko.
"""

from __future__ import annotations

import base64
import getpass
import hashlib
import logging
import os
import shlex
import shutil
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from dflashctl.config import HostConfig
from dflashctl.errors import ConfigError, HostKeyError, UnreachableError
from dflashctl.remote.transport import CHUNK, MAX_OUTPUT_CAPTURED, Result, Runner, feed

# paramiko.config imports `invoke` (and unittest.mock with it: 70 ms of every remote command's start) only to run
# `Match exec` lines of an ssh config itself. dflashctl reads the config through OpenSSH's own `ssh -G`, so invoke is
# kept out while paramiko loads (paramiko allows that: it raises only if such a line is evaluated), and brought in
# by the fallback parser alone (`_paramiko_config`).
_hide_invoke = "invoke" not in sys.modules
if _hide_invoke:
    sys.modules["invoke"] = None  # type: ignore[assignment]
try:
    import paramiko
finally:
    if _hide_invoke:
        del sys.modules["invoke"]


# paramiko logs a failed handshake with a 20-line traceback to stderr; our one-line error says it instead
logging.getLogger("paramiko").addHandler(logging.NullHandler())
logging.getLogger("paramiko").propagate = False

SSH_KEEPALIVE_S = 15  # NAT boxes and Proxmox firewalls drop idle TCP after a few minutes; watch polls are sparse


class _AcceptNewPolicy(paramiko.MissingHostKeyPolicy):
    """ssh's StrictHostKeyChecking=accept-new: record an unknown key; a changed key still fails (paramiko)."""

    def __init__(self, known_hosts_file: Path) -> None:
        self.path = known_hosts_file

    def missing_host_key(self, client, hostname, key) -> None:
        client.get_host_keys().add(hostname, key.get_name(), key)
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")


def fingerprint(key: paramiko.PKey) -> str:
    """SHA256:... as `ssh` and `ssh-keygen -l` print it."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def load_known_hosts(path: Path) -> tuple[paramiko.HostKeys, set[str]]:
    """known_hosts as OpenSSH reads it: `@revoked` keys are collected to be refused, `@cert-authority` lines are
    skipped (no certificates here), and lines that do not parse are skipped, not fatal for every host."""
    keys, revoked = paramiko.HostKeys(), set()
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return keys, revoked
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("@revoked"):
            parts = line.split()
            if len(parts) >= 4:
                revoked.add(parts[3])
            continue
        if line.startswith("@"):
            continue
        try:
            entry = paramiko.hostkeys.HostKeyEntry.from_line(line)
        except Exception:  # paramiko raises several types for one bad line
            continue
        if entry is not None and entry.key is not None:
            for name in entry.hostnames:
                keys.add(name, entry.key.get_name(), entry.key)
    return keys, revoked


class _RefuseUnknownPolicy(paramiko.MissingHostKeyPolicy):
    def missing_host_key(self, client, hostname, key) -> None:
        raise HostKeyError(
            f"host key of {hostname} is not in known_hosts ({key.get_name()} "
            f"{fingerprint(key)}); check it, then run again with --accept-new-host-key to record it"
        )


@dataclass
class SshTarget:
    """A destination with the user's ssh configuration applied: what paramiko needs to connect."""

    hostname: str
    port: int
    user: str
    key_filenames: list[str]
    proxy_jump: str | None
    known_hosts: Path
    proxy_command: str | None = None
    source: str = "ssh -G"  # how the options were resolved: `ssh -G`, or paramiko's parser without an ssh client
    in_config: bool = True  # False: the alias matched no Host block (HostName is the alias itself)


def ssh_config_path() -> Path:
    return Path.home() / ".ssh" / "config"


def _passwd_home() -> str:
    import pwd

    try:
        return pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:
        return str(Path.home())


def _ssh_g(host: HostConfig) -> dict[str, list[str]] | None:
    """`ssh -G DEST`: the options OpenSSH itself would use (Include, Match, ProxyCommand, ProxyJump, Canonicalize...).
    None when no OpenSSH client is installed."""
    ssh = shutil.which("ssh")
    if ssh is None:
        return None
    argv = [ssh, "-G"]
    if str(Path.home()) != _passwd_home():  # ssh reads the passwd home's config; follow $HOME as we do elsewhere
        argv += ["-F", str(ssh_config_path()) if ssh_config_path().is_file() else os.devnull]
    if host.port:
        argv += ["-p", str(host.port)]
    if host.user:
        argv += ["-l", host.user]
    argv.append(host.ssh or "")
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=15, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        detail = (proc.stderr.strip().splitlines() or ["ssh -G failed"])[-1]
        raise ConfigError(str(ssh_config_path()), None, f"ssh cannot resolve {host.ssh!r}: {detail}")
    opts: dict[str, list[str]] = {}
    for line in proc.stdout.splitlines():
        key, _, value = line.partition(" ")
        opts.setdefault(key.lower(), []).append(value)
    return opts


def _home_path(value: str) -> Path:
    """A path from ssh -G, whose `~` is the passwd home: with $HOME elsewhere, the same file under $HOME."""
    home = _passwd_home()
    if str(Path.home()) != home and (value == home or value.startswith(home + "/")):
        value = str(Path.home()) + value[len(home) :]
    return Path(value).expanduser()


def resolve_ssh_target(host: HostConfig) -> SshTarget:
    """The destination as the user's own `ssh` resolves it (`ssh -G`); paramiko's parser only without a client."""
    assert host.ssh is not None
    user_in_dest, _, alias = host.ssh.rpartition("@")
    g = _ssh_g(host)
    if g is not None:
        one = lambda k, d=None: (g.get(k) or [d])[0]  # noqa: E731
        proxy = one("proxycommand")
        jump = one("proxyjump")
        keys = [host.identity_file] if host.identity_file else g.get("identityfile", [])
        hostname = one("hostname", alias)
        return SshTarget(
            hostname=hostname,
            port=int(one("port", "22")),
            user=one("user") or getpass.getuser(),
            key_filenames=[str(p) for p in map(_home_path, keys) if p.is_file()],
            proxy_jump=None if jump in (None, "none") else jump,
            known_hosts=_home_path((one("userknownhostsfile") or "~/.ssh/known_hosts").split()[0]),
            proxy_command=None if proxy in (None, "none") else proxy,
            in_config=hostname != alias or bool(proxy and proxy != "none"),
        )
    cfg = _paramiko_config(ssh_config_path())
    opts = cfg.lookup(alias)
    known = opts.get("userknownhostsfile", "~/.ssh/known_hosts").split()[0]
    keys = [host.identity_file] if host.identity_file else list(opts.get("identityfile", []))
    return SshTarget(
        hostname=opts.get("hostname", alias),
        port=host.port or int(opts.get("port", 22)),
        user=host.user or user_in_dest or opts.get("user") or getpass.getuser(),
        key_filenames=[str(Path(k).expanduser()) for k in keys if Path(k).expanduser().is_file()],
        proxy_jump=opts.get("proxyjump"),
        known_hosts=Path(known).expanduser(),
        proxy_command=opts.get("proxycommand"),
        source="paramiko",
        in_config="hostname" in opts,
    )


def _paramiko_config(path: Path) -> paramiko.SSHConfig:
    """The fallback parser (no `ssh` on this machine), with invoke back for its `Match exec` lines."""
    if paramiko.config.invoke is None:
        try:
            import invoke

            paramiko.config.invoke = invoke
        except ImportError:  # paramiko says so if a `Match exec` line is evaluated
            pass
    return paramiko.SSHConfig.from_path(str(path)) if path.is_file() else paramiko.SSHConfig()


def client_options(host: HostConfig) -> list[str]:
    """Options for the system's ssh (`tunnel`) so that it reads the files dflashctl reads: OpenSSH takes `~` from
    the passwd entry, dflashctl from $HOME; when they differ, name $HOME's config and known_hosts."""
    if str(Path.home()) == _passwd_home():
        return []
    target = resolve_ssh_target(host)
    config = str(ssh_config_path()) if ssh_config_path().is_file() else os.devnull
    return ["-F", config, "-o", f"UserKnownHostsFile={target.known_hosts}"]


def _expand_proxy_command(cmd: str, target: SshTarget) -> str:
    """ProxyCommand's tokens, as ssh expands them."""
    out, i = [], 0
    table = {"h": target.hostname, "p": str(target.port), "r": target.user, "%": "%"}
    while i < len(cmd):
        if cmd[i] == "%" and i + 1 < len(cmd) and cmd[i + 1] in table:
            out.append(table[cmd[i + 1]])
            i += 2
        else:
            out.append(cmd[i])
            i += 1
    return "".join(out)


def _jump_host(spec: str, timeout: float) -> HostConfig:
    """The first hop of ProxyJump `[user@]host[:port][,next...]` (later hops are the jump host's own ProxyJump)."""
    first = spec.split(",")[0].removeprefix("ssh://")
    user, _, rest = first.rpartition("@")
    name, _, port = rest.partition(":")
    dest = f"{user}@{name}" if user else name
    return HostConfig(name=first, ssh=dest, port=int(port) if port.isdigit() else None, connect_timeout=timeout)


class SshRunner(Runner):
    """A remote host over ssh (paramiko): one connection per runner, kept alive, host keys verified."""

    connections_opened = 0  # counted across runners: benchmarks report connections per CLI command

    def __init__(self, host: HostConfig, accept_new_host_key: bool = False) -> None:
        super().__init__(host)
        self.accept_new_host_key = accept_new_host_key
        self._client: paramiko.SSHClient | None = None
        self._jump: SshRunner | None = None
        self._spare: paramiko.Channel | None = None  # a session opened ahead by connect(), used by the next command

    def _connect(self) -> paramiko.SSHClient:
        if self._client is not None:
            return self._client
        target = resolve_ssh_target(self.host)
        where = f"{self.host.name or self.host.ssh} ({target.user}@{target.hostname}:{target.port})"
        client = paramiko.SSHClient()
        known, revoked = load_known_hosts(target.known_hosts)
        for name in list(known):
            for keytype, key in known[name].items():
                client.get_host_keys().add(name, keytype, key)
        client.set_missing_host_key_policy(
            _AcceptNewPolicy(target.known_hosts) if self.accept_new_host_key else _RefuseUnknownPolicy()
        )
        sock = None
        timeout = self.host.connect_timeout
        try:
            if target.proxy_command:
                sock = paramiko.ProxyCommand(_expand_proxy_command(target.proxy_command, target))
            elif target.proxy_jump:
                jump_host = _jump_host(target.proxy_jump, timeout)
                self._jump = SshRunner(jump_host, self.accept_new_host_key)
                jt = self._jump._connect().get_transport()
                sock = jt.open_channel("direct-tcpip", (target.hostname, target.port), ("127.0.0.1", 0))
            client.connect(
                target.hostname,
                port=target.port,
                username=target.user,
                key_filename=target.key_filenames or None,
                timeout=timeout,
                banner_timeout=timeout,
                auth_timeout=timeout,
                channel_timeout=timeout,
                sock=sock,
            )
        except HostKeyError:
            raise
        except paramiko.BadHostKeyException as e:
            raise HostKeyError(
                f"host key of {where} has CHANGED (got {e.key.get_name()} {fingerprint(e.key)}): "
                f"refusing to connect; if the host was reinstalled, remove its line from {target.known_hosts}"
            ) from None
        except paramiko.AuthenticationException as e:
            raise UnreachableError(f"{where}: authentication failed: {e}") from None
        except TimeoutError:
            raise UnreachableError(f"{where}: no answer within {timeout:g} s") from None
        except socket.gaierror:
            alias = self.host.ssh.rpartition("@")[2] if self.host.ssh else "?"
            hint = f"`{alias}` is not a Host in your ssh config and " if not target.in_config else ""
            named = ""
            if not target.in_config and self.host.name == alias:  # a bare name, not a host of dflashctl.yaml
                named = f"; to name a host `{alias}`, define it in dflashctl.yaml (see dflashctl.example.yaml)"
            raise UnreachableError(f"{where}: cannot connect: {hint}no such host name{named}") from None
        except (OSError, EOFError, paramiko.SSHException) as e:
            reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
            if "banner" in reason.lower() or "no existing session" in reason.lower():
                reason = f"no ssh answer within {timeout:g} s ({reason})"
            raise UnreachableError(f"{where}: cannot connect: {reason}") from None
        transport = client.get_transport()
        assert transport is not None
        server_key = transport.get_remote_server_key()
        if server_key.get_base64() in revoked:
            client.close()
            raise HostKeyError(
                f"host key of {where} ({fingerprint(server_key)}) is marked @revoked in "
                f"{target.known_hosts}: refusing it"
            )
        transport.set_keepalive(SSH_KEEPALIVE_S)
        SshRunner.connections_opened += 1
        self._client = client
        return client

    def connect(self) -> None:
        """The handshake, and one session channel opened ahead (a round trip) for the first command to use."""
        transport = self._connect().get_transport()
        if self._spare is None and transport is not None:
            try:
                self._spare = transport.open_session(timeout=self.host.connect_timeout)
            except (paramiko.SSHException, OSError):
                self._spare = None  # the command opens its own, and says what went wrong

    def check_connection(self) -> None:
        self._connect()
        super().check_connection()

    def _exec(self, argv, stdin, timeout, progress, heard=None) -> Result:
        client = self._connect()
        transport = client.get_transport()
        if transport is None or not transport.is_active():
            raise UnreachableError(f"{self.host.name}: connection lost")
        try:
            chan, self._spare = self._spare, None
            if chan is None or chan.closed:
                chan = transport.open_session(timeout=self.host.connect_timeout)
            chan.settimeout(timeout)
            chan.exec_command(shlex.join(argv))
        except (paramiko.SSHException, OSError) as e:
            raise UnreachableError(f"{self.host.name}: connection lost: {e}") from None
        out, err = bytearray(), bytearray()

        def drain(recv, sink: bytearray, hear) -> None:
            try:
                while True:
                    data = recv(CHUNK)
                    if not data:
                        return
                    if hear:
                        hear(data)
                    if len(sink) < MAX_OUTPUT_CAPTURED:
                        sink.extend(data[: MAX_OUTPUT_CAPTURED - len(sink)])
            except TimeoutError:
                return
            finally:
                if hear:
                    hear(b"")

        readers = [
            threading.Thread(target=drain, args=(chan.recv, out, heard), daemon=True),
            threading.Thread(target=drain, args=(chan.recv_stderr, err, None), daemon=True),
        ]
        for t in readers:
            t.start()
        feed(chan.sendall, chan.shutdown_write, stdin, progress)
        for t in readers:
            t.join()
        if not chan.status_event.wait(timeout):
            chan.close()
            return Result(argv, 124, bytes(out), bytes(err) + b"dflashctl: remote command timed out\n")
        code = chan.recv_exit_status()
        chan.close()
        return Result(argv, code, bytes(out), bytes(err))

    def close(self) -> None:
        if self._spare is not None:
            self._spare.close()
            self._spare = None
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._jump is not None:
            self._jump.close()
            self._jump = None
