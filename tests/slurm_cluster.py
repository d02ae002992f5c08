"""A real one-machine Slurm cluster for the tests: munged, slurmctld and two slurmd (nodes `n1`, `n2`, Slurm's
multiple-slurmd mode) on this machine, CPUs only.

Everything lives under one directory (config, state, spool, logs, munge's key and socket) and the daemons are
started by the suite and stopped by pid; the machine's own Slurm, if any, is never touched. Where the daemons cannot
start (no slurm-wlm, not root, a hostname that does not resolve), `start_cluster` raises `ClusterUnavailable` saying
why, and the tests skip with that reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "srun", "sinfo")


class ClusterUnavailable(RuntimeError):
    """Why this machine cannot run the test cluster."""


NODES = ("n1", "n2")
# how long a daemon may take to come up or answer: only a failure waits this long, and a loaded machine (a CI runner
# with a second suite on it) takes far longer than an idle one
WAIT_S = 120.0


@dataclass
class Cluster:
    dir: Path
    conf: Path
    nodes: tuple[str, ...] = NODES
    partition: str = "debug"
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def node(self) -> str:
        """The first node: where a one-node job lands while both are idle."""
        return self.nodes[0]

    @property
    def hostlist(self) -> str:
        return ",".join(self.nodes)

    @property
    def env(self) -> dict[str, str]:
        """What the cluster's client commands need (a real login node has it in /etc/slurm)."""
        return {"SLURM_CONF": str(self.conf)}

    def scontrol(self, *args: str) -> str:
        res = subprocess.run(
            ["scontrol", *args], env={**os.environ, **self.env}, capture_output=True, text=True, timeout=30
        )
        if res.returncode != 0:
            raise RuntimeError(f"scontrol {' '.join(args)}: {res.stderr.strip()}")
        return res.stdout

    def drain(self, reason: str = "tests") -> None:
        self.scontrol("update", f"NodeName={self.hostlist}", "State=DRAIN", f"Reason={reason}")

    def resume(self) -> None:
        self.scontrol("update", f"NodeName={self.hostlist}", "State=RESUME")

    def stop_controller(self) -> None:
        """slurmctld goes away (a crash, a restart for maintenance); the jobs on the node keep running."""
        ctld = self.procs[1]
        ctld.terminate()
        ctld.wait(60)

    def start_controller(self) -> None:
        """slurmctld comes back and reads its saved state: the jobs it knew are known again, and every node has
        registered with it again (a loaded machine's slurmd takes a while: a kill before that waits on it)."""
        log = open(self.dir / "log" / "daemons.log", "ab")  # noqa: SIM115 - kept open for the daemon's lifetime
        self.procs[1] = subprocess.Popen(
            [_find("slurmctld"), "-D", "-i", "-f", str(self.conf)],
            stdout=log,
            stderr=log,
            env={**os.environ, **self.env},
        )
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            res = subprocess.run(
                ["scontrol", "ping"], env={**os.environ, **self.env}, capture_output=True, text=True, timeout=30
            )
            if "UP" in res.stdout:
                self.wait_idle()
                return
            time.sleep(0.2)
        raise RuntimeError(f"slurmctld did not come back: see {self.dir}/log")

    def resume_if_drained(self) -> None:
        """A test that failed while a node was drained or down leaves it so: the next test starts from idle nodes."""
        info = self.scontrol("show", "node", self.hostlist)
        if "DRAIN" in info or "DOWN" in info:
            self.resume()
        self.wait_idle()

    def wait_idle(self, timeout: float = WAIT_S) -> None:
        """Every node takes jobs (after a start or a resume)."""
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            argv = ["sinfo", "-h", "-N", "-p", self.partition, "-n", self.hostlist, "-o", "%t"]
            res = subprocess.run(argv, env={**os.environ, **self.env}, capture_output=True, text=True, timeout=30)
            states = res.stdout.split()
            if len(states) == len(self.nodes) and all(st in ("idle", "mix", "alloc") for st in states):
                return
            time.sleep(0.2)
        raise ClusterUnavailable(f"the nodes {self.hostlist} did not come up (states {states!r}): see {self.dir}/log")

    def stop(self) -> None:
        """Cancel every job of this cluster (slurmd's steps would outlive it), then stop the daemons by pid."""
        if self.procs and self.procs[1].poll() is None:
            env = {**os.environ, **self.env}
            subprocess.run(["scancel", "--full", "--user=root"], env=env, capture_output=True, timeout=30)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                res = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True, timeout=30)
                if res.returncode != 0 or not res.stdout.strip():
                    break
                time.sleep(0.2)
        for proc in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.procs.clear()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _find(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if Path(p).exists()), None)


def start_cluster(d: Path, cpus: int = 2, kill_wait_s: int = 2) -> Cluster:
    """Write the config under `d` and start the daemons; both nodes are idle when this returns."""
    missing = [n for n in (*DAEMONS, *CLIENTS) if _find(n) is None]
    if missing:
        raise ClusterUnavailable(
            f"Slurm is not installed here ({', '.join(missing)} missing): `make test` installs "
            "slurmctld, slurmd, slurm-client and munge"
        )
    if os.geteuid() != 0:
        raise ClusterUnavailable("the test cluster runs its daemons as root (SlurmUser=root); this user is not")
    host = socket.gethostname().split(".")[0]
    try:
        socket.gethostbyname(host)
    except OSError:
        why = f"this machine's hostname {host!r} does not resolve (slurmctld names its host so)"
        raise ClusterUnavailable(why) from None
    for sub in ("state", "spool", "log", "munge"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(d / "munge", 0o700)
    key = d / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    sock = d / "munge" / "sock"
    if len(str(sock)) > 100:
        raise ClusterUnavailable(f"the munge socket's path is too long for a unix socket: {sock}")
    conf = d / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=dflashtest",
                f"SlurmctldHost={host}(127.0.0.1)",
                f"SlurmctldPort={_free_port()}",
                "SlurmUser=root",
                "AuthType=auth/munge",
                f"AuthInfo=socket={sock}",
                "CredType=cred/munge",
                f"StateSaveLocation={d / 'state'}",
                f"SlurmdSpoolDir={d / 'spool'}/%n",
                f"SlurmctldPidFile={d / 'slurmctld.pid'}",
                f"SlurmdPidFile={d / 'slurmd-%n.pid'}",
                f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
                f"SlurmdLogFile={d / 'log' / 'slurmd-%n.log'}",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_CPU",
                "MinJobAge=3600",  # ended jobs stay in the controller's memory: their final state is read with scontrol
                f"KillWait={kill_wait_s}",
                "MessageTimeout=3",  # a client's wait on a controller that is away (default 10 s, retried)
                "ReturnToService=2",
                "MpiDefault=none",
                "SchedulerType=sched/backfill",
                "SlurmdParameters=config_overrides",  # a node has the CPUs the config says: jobs that sleep share cores
                *(
                    f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={_free_port()} CPUs={cpus} State=UNKNOWN"
                    for n in NODES
                ),
                # a job of partition `high` preempts (cancels) the jobs of `debug` it needs the nodes of
                "PreemptType=preempt/partition_prio",
                "PreemptMode=CANCEL",
                f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP PriorityTier=1",
                f"PartitionName=high Nodes={','.join(NODES)} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF",
            ]
        )
        + "\n"
    )
    for n in NODES:
        (d / "spool" / n).mkdir(parents=True, exist_ok=True)
    cluster = Cluster(d, conf)
    env = {**os.environ, **cluster.env}
    log = open(d / "log" / "daemons.log", "ab")  # noqa: SIM115 - kept open for the daemons' lifetime
    try:
        cluster.procs.append(
            subprocess.Popen(
                [
                    _find("munged"),
                    "-F",
                    "-f",
                    f"--socket={sock}",
                    f"--key-file={key}",
                    f"--pid-file={d / 'munge.pid'}",
                    f"--log-file={d / 'log' / 'munged.log'}",
                    f"--seed-file={d / 'munge' / 'seed'}",
                ],
                stdout=log,
                stderr=log,
                env=env,
            )
        )
        deadline = time.monotonic() + 30
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not sock.exists():
            raise ClusterUnavailable(f"munged did not start: see {d / 'log'}")
        cluster.procs.append(
            subprocess.Popen([_find("slurmctld"), "-D", "-i", "-f", str(conf)], stdout=log, stderr=log, env=env)
        )
        for n in NODES:
            cluster.procs.append(
                subprocess.Popen([_find("slurmd"), "-D", "-f", str(conf), "-N", n], stdout=log, stderr=log, env=env)
            )
        cluster.wait_idle()
    except BaseException:
        cluster.stop()
        raise
    return cluster
