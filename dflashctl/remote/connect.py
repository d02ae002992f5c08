"""The runner for a host: a subprocess for this machine, an ssh connection (paramiko) for any other."""

from __future__ import annotations

from dflashctl.config import HostConfig
from dflashctl.remote.transport import LocalRunner, Runner


def open_runner(host: HostConfig, accept_new_host_key: bool = False) -> Runner:
    """Connecting is lazy: nothing touches the network until the first command."""
    if host.is_local:
        return LocalRunner(host)
    from dflashctl.remote.ssh import SshRunner  # paramiko is imported only for a remote host

    return SshRunner(host, accept_new_host_key)
