"""doctor: can this host run our jobs? One remote command gathers the facts; each becomes a check with a verdict."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from dflashctl.config import HostConfig
from dflashctl.remote.transport import WORKDIR_PRELUDE, Runner

MIN_FREE_GIB = 20.0  # checkpoints of an 8B-target drafter run are a few GiB each; keep room for several
MAX_CLOCK_OFFSET_S = 1.0  # the wall stamps `status` shows from the remote are compared with ours by the reader
GPU_QUERY = [
    "nvidia-smi",
    "--query-gpu=index,name,memory.total,ecc.errors.uncorrected.volatile.total",
    "--format=csv,noheader,nounits",
]
# nvidia-smi absent is told apart from one that ran and found nothing by our own status, whatever the layer between
# (ssh, `pct exec`, `docker exec`) makes of a missing executable
NO_NVIDIA_SMI = 127
GPU_QUERY_ARGV = [
    "sh",
    "-c",
    f'command -v nvidia-smi >/dev/null 2>&1 || exit {NO_NVIDIA_SMI}; exec "$@"',
    "gpu-query",
    *GPU_QUERY,
]

# Prints key=value lines; each probe tolerates the tool being absent (a missing line reads as an empty fact). $1 is
# the workdir, $2 the Python: one interpreter says its version, then torch's and NCCL's (torch imported once: seconds
# on a loaded login node), and stops at the first that is missing.
FACTS_SCRIPT = (
    WORKDIR_PRELUDE
    + r"""py="$1"
"$py" -c 'import sys
print("python=" + sys.version.split()[0], flush=True)
import torch as t
c = t.cuda
print("torch=%s %s %s %s" % (t.__version__, t.version.cuda, c.is_available(), c.device_count()), flush=True)
print("nccl=" + ".".join(map(str, c.nccl.version())))' 2>/dev/null
echo "tmux=$(tmux -V 2>/dev/null)"
echo "rsync=$(rsync --version 2>/dev/null | head -n 1)"
d="$wd"; while [ ! -d "$d" ] && [ "$d" != / ]; do d=$(dirname -- "$d"); done
echo "disk=$(df -Pk -- "$d" 2>/dev/null | awk 'NR==2 {print $4}') $d"
"""
)


@dataclass
class Check:
    name: str
    status: str  # "ok" | "warn" | "fail"
    detail: str
    required: bool = False


@dataclass
class DoctorReport:
    host: str
    checks: list[Check]
    facts: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not any(c.status == "fail" and c.required for c in self.checks)

    def to_dict(self) -> dict:
        return {"host": self.host, "ok": self.ok, "checks": [asdict(c) for c in self.checks]}


def parse_facts(text: str) -> dict[str, str]:
    facts: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            facts[key.strip()] = value.strip()
    return facts


def no_gpu_detail(code: int, said: str, host: HostConfig) -> str:
    """Why doctor sees no GPU, in words that lead to the fix: nvidia-smi not installed (where it was looked for),
    nvidia-smi failing (its own last line: a driver not loaded, a container without the devices), or nvidia-smi
    running and finding none."""
    where = (
        "on the container's host"
        if host.gpu_query == "host" and host.container
        else ("in the container" if host.container else f"on {host.name}")
    )
    last = (said.strip().splitlines() or [""])[-1][:200]
    if code == NO_NVIDIA_SMI:
        return f"nvidia-smi is not installed {where}: no GPU can be seen (CPU-only jobs still run)"
    if code != 0 and "No devices were found" not in said:
        return f"nvidia-smi failed {where} (exit {code}{': ' + last if last else ''}) (CPU-only jobs still run)"
    return f"nvidia-smi found no GPU {where} (CPU-only jobs still run)"


def parse_gpu_csv(text: str) -> list[dict]:
    """`nvidia-smi --query-gpu=index,name,memory.total[,ecc...uncorrected] --format=csv,noheader,nounits` ->
    [{index, name, memory_mib, ecc_uncorrected}] (None where the GPU has no ECC or nvidia-smi says N/A)."""
    gpus = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3 and parts[0].isdigit():
            ecc = int(parts[3]) if len(parts) > 3 and parts[3].isdigit() else None
            gpus.append(
                {"index": int(parts[0]), "name": parts[1], "memory_mib": int(float(parts[2])), "ecc_uncorrected": ecc}
            )
    return gpus


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(".")[:2] if x.isdigit())


def run_doctor(runner: Runner) -> DoctorReport:
    host = runner.host
    checks: list[Check] = []
    # An unreachable host or a refused host key raises: a one-line error with exit status 2, not a table.
    res = runner.run_script(FACTS_SCRIPT, host.workdir, host.python, timeout=120)
    where = "local" if host.is_local else f"ssh {host.ssh}"
    checks.append(Check("reachable", "ok", where, required=True))
    if host.container:
        ok = res.returncode == 0
        detail = host.container if ok else (res.err.strip().splitlines() or ["exec failed"])[-1]
        checks.append(Check("container exec", "ok" if ok else "fail", detail, required=True))
        if not ok:
            return DoctorReport(host.name, checks)
    elif res.returncode != 0:
        checks.append(Check("shell", "fail", (res.err.strip().splitlines() or ["bash failed"])[-1], required=True))
        return DoctorReport(host.name, checks)
    facts = parse_facts(res.out)

    py = facts.get("python", "")
    if not py:
        checks.append(Check("python", "fail", f"{host.python} not found", required=True))
    elif _version_tuple(py) < (3, 8):
        checks.append(Check("python", "fail", f"{host.python} is {py}; need >= 3.8", required=True))
    else:
        checks.append(Check("python", "ok", f"{host.python} {py}", required=True))

    torch_fact = facts.get("torch", "").split()
    if len(torch_fact) == 4:
        version, cuda, available, count = torch_fact
        status = "ok" if available == "True" else "warn"
        checks.append(Check("torch", status, f"{version} (CUDA {cuda}, available={available}, devices={count})"))
    else:
        checks.append(Check("torch", "warn", "not importable: the bundled trainer cannot run (command: jobs can)"))

    gpu_res = runner.run(GPU_QUERY_ARGV, on_host=host.gpu_query == "host", timeout=60)
    gpus = parse_gpu_csv(gpu_res.out) if gpu_res.returncode == 0 else []
    if gpus:
        names = ", ".join(f"{g['index']}: {g['name']} {g['memory_mib'] / 1024:.0f} GiB" for g in gpus)
        checks.append(Check("gpus", "ok", f"{len(gpus)} ({names})"))
        for g in gpus:
            if g["ecc_uncorrected"]:
                why = (
                    f"{g['ecc_uncorrected']} uncorrectable ECC errors: launch refuses this GPU (--force "
                    "overrides); have it checked or reset"
                )
                checks.append(Check(f"gpu {g['index']}", "fail", why))
    else:
        checks.append(Check("gpus", "warn", no_gpu_detail(gpu_res.returncode, gpu_res.out + gpu_res.err, host)))

    tmux = facts.get("tmux", "")
    checks.append(Check("tmux", "ok" if tmux else "fail", tmux or "not installed: jobs run in tmux", required=True))
    rsync = facts.get("rsync", "")
    checks.append(Check("rsync", "ok" if rsync else "warn", rsync or "not installed (deploy streams tar instead)"))

    disk = facts.get("disk", "").split(maxsplit=1)
    if disk and disk[0].isdigit():
        free_gib = int(disk[0]) / (1 << 20)
        status = "ok" if free_gib >= MIN_FREE_GIB else "warn"
        checks.append(Check("disk", status, f"{free_gib:.1f} GiB free at {disk[1] if len(disk) > 1 else '?'}"))
    else:
        checks.append(Check("disk", "warn", "df gave no reading"))

    checks.append(agent_check(runner))
    if host.is_local:
        checks.append(Check("clock", "ok", "this machine: the clock every other host is compared with"))
        return DoctorReport(host.name, checks, facts)
    checks.append(clock_check(runner))
    return DoctorReport(host.name, checks, facts)


def agent_check(runner: Runner) -> Check:
    """The agent, run exactly as deploy, launch and every poll run it (the same boot line, interpreter and reading of
    its answer): where this fails, they fail; a banner its Python prints first is skipped by them and named here."""
    from dflashctl.errors import ProbeFailedError
    from dflashctl.remote.agent_bundle import NOISE_SEEN
    from dflashctl.remote.session import call_agent

    try:
        ans = call_agent(runner, {"action": "hello", "gpus": False}, timeout=120)
    except ProbeFailedError as e:
        return Check("agent", "fail", str(e), required=True)
    if not ans.get("ok"):
        return Check("agent", "fail", f"the agent answered {ans!r}", required=True)
    where = f"{ans.get('python')} {ans.get('version')}" + ("" if ans.get("isolated") else " (not isolated)")
    noise = NOISE_SEEN.get(runner.host.name)
    if noise:
        first = noise.decode("utf-8", "replace").strip().splitlines()[:1] or ["blank lines"]
        return Check(
            "agent",
            "warn",
            f"runs under {where}, but its Python printed {len(noise)} bytes on stdout first "
            f"(skipped): {first[0][:80]!r}",
        )
    return Check("agent", "ok", f"runs under {where}", required=True)


def clock_offset(remote: float, sent: float, received: float) -> tuple[float, float]:
    """(offset, uncertainty) of a remote clock read once during a round trip: against the round trip's midpoint, and
    it can be anywhere within half the round trip of it."""
    return remote - (sent + received) / 2, (received - sent) / 2


def rate_clock(offset: float, uncertainty: float) -> Check:
    """ok only when the offset, even at the far end of its uncertainty, is within MAX_CLOCK_OFFSET_S."""
    status = "ok" if abs(offset) + uncertainty <= MAX_CLOCK_OFFSET_S else "warn"
    return Check("clock", status, f"offset {offset:+.3f} s \u00b1 {uncertainty:.3f} s (limit {MAX_CLOCK_OFFSET_S:g} s)")


def clock_check(runner: Runner) -> Check:
    """One short round trip of its own (the facts script imports torch: seconds that would pass for an offset)."""
    sent = time.time()
    res = runner.run(["date", "+%s.%N"], timeout=30)
    received = time.time()
    try:
        return rate_clock(*clock_offset(float(res.out.strip()), sent, received))
    except ValueError:
        return Check("clock", "warn", "remote date gave no reading")


# The head listens on the rendezvous port for a few seconds and counts who connected; every other node connects.
LISTEN = (
    "import socket,sys,time\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
    "try:\n s.bind(('0.0.0.0',int(sys.argv[1])))\nexcept OSError as e:\n print('busy',e.strerror);sys.exit(0)\n"
    "s.listen(64);s.settimeout(0.2);end=time.time()+float(sys.argv[2]);n=0;print('listening',flush=True)\n"
    "while time.time()<end and n<int(sys.argv[3]):\n try:\n  c,_=s.accept();n+=1;c.close()\n except OSError:\n  pass\n"
    "print('accepted',n)"
)
CONNECT = (
    "import socket,sys,time\nend=time.time()+float(sys.argv[3]);err='timed out'\n"
    "while time.time()<end:\n try:\n  socket.create_connection((sys.argv[1],int(sys.argv[2])),timeout=2).close()"
    ";print('ok');sys.exit(0)\n except OSError as e:\n  err=e.strerror or str(e);time.sleep(0.2)\nprint('fail',err)"
)


def node_checks(
    reports: list[DoctorReport], runners: list[Runner], head_addr: str, port: int, listen_s: float = 8.0
) -> DoctorReport:
    """What only a multi-node job needs: every node reaches the head's rendezvous port, and the nodes run the same
    torch and NCCL (a mismatch hangs or crashes the first collective)."""
    checks = []
    for fact, what in (("torch", "torch"), ("nccl", "NCCL")):
        seen = {r.host: (r.facts.get(fact) or "").split(" ")[0] or "none" for r in reports}
        same = len(set(seen.values())) == 1
        checks.append(
            Check(
                f"{what} versions",
                "ok" if same else "fail",
                ", ".join(f"{h} {v}" for h, v in seen.items()),
                required=fact == "torch",
            )
        )
    head = runners[0]
    answer: dict = {}

    def listen() -> None:
        argv = [head.host.python, "-c", LISTEN, str(port), str(listen_s), str(len(runners) - 1)]
        answer["res"] = head.run(argv, timeout=listen_s + 30)

    t = threading.Thread(target=listen)
    t.start()
    for r, rep in zip(runners[1:], reports[1:], strict=True):
        res = r.run([r.host.python, "-c", CONNECT, head_addr, str(port), str(listen_s - 2)], timeout=listen_s + 30)
        ok = res.out.strip() == "ok"
        detail = f"{head_addr}:{port} " + ("reached" if ok else f"not reached: {res.out.strip()[5:] or res.err[-120:]}")
        checks.append(Check(f"rendezvous from {rep.host}", "ok" if ok else "fail", detail, required=True))
    t.join()
    said = answer["res"].out.strip().splitlines()
    if said and said[0].startswith("busy"):
        checks.append(
            Check("rendezvous port", "fail", f"{port} is in use on {reports[0].host}: {said[0][5:]}", required=True)
        )
    return DoctorReport("job", checks)


def run_nodes_doctor(hosts: list, open_runner: Callable, head_addr: str, port: int) -> list[DoctorReport]:
    """Every node's own checks, then the job's: one report per node and one named `job`."""
    from concurrent.futures import ThreadPoolExecutor

    runners = [open_runner(h) for h in hosts]
    try:
        with ThreadPoolExecutor(max_workers=min(16, len(runners))) as pool:  # every node at once
            reports = list(pool.map(run_doctor, runners))
        if all(r.ok for r in reports):
            reports.append(node_checks(reports, runners, head_addr, port))
        return reports
    finally:
        for r in runners:
            r.close()
