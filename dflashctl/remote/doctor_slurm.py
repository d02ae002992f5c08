"""doctor for a Slurm host: the login node answers, the scheduler's commands are there, the partition and account are
valid, and a compute node sees the workdir and imports torch (one short `srun`).

Two remote commands: the login node's facts, then the srun (which may wait in the queue: it gives up after
`--immediate` seconds and says so).
"""

from __future__ import annotations

import shlex
import time

from dflashctl.remote.doctor import MIN_FREE_GIB, Check, DoctorReport, _version_tuple, parse_facts
from dflashctl.remote.transport import WORKDIR_PRELUDE, Runner

REQUIRED_TOOLS = ("sbatch", "squeue", "scontrol", "scancel", "srun")
OPTIONAL_TOOLS = ("sacct", "sinfo", "sattach", "sacctmgr")
SRUN_WAIT_S = 60  # how long the compute-node check may wait for an allocation

# $1 workdir, $2 python, $3 partition ("" = the default), $4 account ("" = none). Prints key=value lines.
FACTS_SCRIPT = (
    WORKDIR_PRELUDE
    + r"""py="$1"; part="$2"; acct="$3"
echo "python=$("$py" -c 'import sys; print(sys.version.split()[0])' 2>/dev/null)"
for t in """
    + " ".join(REQUIRED_TOOLS + OPTIONAL_TOOLS)
    + r"""; do command -v "$t" >/dev/null 2>&1 && echo "tool_$t=1" || echo "tool_$t=0"; done
ping=$(scontrol ping 2>&1 | head -n 1); echo "controller_rc=$?"; echo "controller=$ping"
if [ -n "$part" ]; then
  echo "partition=$(sinfo -h -p "$part" -o '%P|%a|%D' 2>/dev/null | head -n 1)"
else
  echo "partition=$(sinfo -h -o '%P|%a|%D' 2>/dev/null | grep '\*' | head -n 1)"
fi
if [ -n "$acct" ]; then
  a=$(sacctmgr -n -P show assoc where user="$(id -un)" account="$acct" format=Account 2>&1 | head -n 1)
  echo "account_rc=$?"; echo "account=$a"
fi
echo "slurm=$(sinfo --version 2>/dev/null)"
d="$wd"; while [ ! -d "$d" ] && [ "$d" != / ]; do d=$(dirname -- "$d"); done
echo "disk=$(df -Pk -- "$d" 2>/dev/null | awk 'NR==2 {print $4}') $d"
echo "fs=$(stat -f -c %T -- "$d" 2>/dev/null)"
echo "probe_dir=$d"
echo "time=$(date +%s.%N)"
"""
)

# On one compute node: is the login node's workdir there, and which torch does the job's Python import?
NODE_SCRIPT = (
    'echo "node=$(hostname)"; [ -d "$1" ] && echo seen=1 || echo seen=0; '
    "\"$2\" -c \"import torch; print('torch=' + torch.__version__, 'cuda=' + str(torch.cuda.is_available()))\" "
    "2>/dev/null || echo torch=none"
)


def run_slurm_doctor(runner: Runner) -> DoctorReport:
    host = runner.host
    cluster = host.slurm
    assert cluster is not None
    checks: list[Check] = []
    t0 = time.time()
    res = runner.run_script(
        FACTS_SCRIPT, host.workdir, host.python, cluster.partition or "", cluster.account or "", timeout=120
    )
    t1 = time.time()
    checks.append(Check("reachable", "ok", f"login node {host.ssh or 'this machine'}", required=True))
    if res.returncode != 0:
        checks.append(Check("shell", "fail", (res.err.strip().splitlines() or ["bash failed"])[-1], required=True))
        return DoctorReport(host.name, checks)
    facts = parse_facts(res.out)

    py = facts.get("python", "")
    ok = bool(py) and _version_tuple(py) >= (3, 8)
    checks.append(
        Check(
            "python",
            "ok" if ok else "fail",
            f"{host.python} {py}" if py else f"{host.python} not found (the agent runs on the login node)",
            required=True,
        )
    )

    missing = [t for t in REQUIRED_TOOLS if facts.get(f"tool_{t}") != "1"]
    absent = [t for t in OPTIONAL_TOOLS if facts.get(f"tool_{t}") != "1"]
    detail = f"{facts.get('slurm') or 'slurm'}: " + (f"missing {', '.join(missing)}" if missing else "all found")
    if absent:
        detail += f"; without {', '.join(absent)}"
    checks.append(Check("slurm tools", "fail" if missing else "ok", detail, required=True))
    if missing:
        return DoctorReport(host.name, checks, facts)

    said = facts.get("controller", "")
    if "UP" not in said and "is up" not in said.lower():  # `Slurmctld(primary) at host is UP`, else DOWN or an error
        checks.append(
            Check(
                "controller",
                "fail",
                f"slurmctld does not answer the login node: {said[:160] or 'no word'}"
                " (the partition and account cannot be checked)",
                required=True,
            )
        )
        return DoctorReport(host.name, checks, facts)
    checks.append(Check("controller", "ok", said[:160]))
    part = facts.get("partition", "").split("|")
    name = cluster.partition or "the default partition"
    if len(part) < 2 or not part[0]:
        checks.append(Check("partition", "fail", f"{name}: sinfo does not know it", required=True))
    else:
        up = part[1] == "up"
        checks.append(
            Check(
                "partition",
                "ok" if up else "fail",
                f"{part[0].rstrip('*')}: {part[1]}, {part[2] if len(part) > 2 else '?'} nodes",
                required=True,
            )
        )

    if cluster.account:
        said = facts.get("account", "")
        if facts.get("account_rc") == "0" and said.strip() == cluster.account:
            checks.append(Check("account", "ok", f"{cluster.account}: an association of this user"))
        elif facts.get("account_rc") == "0" and not said.strip():
            checks.append(
                Check("account", "fail", f"{cluster.account}: no association for this user (sacctmgr)", required=True)
            )
        else:
            checks.append(Check("account", "warn", f"{cluster.account}: cannot be checked here ({said[:120]})"))

    disk = facts.get("disk", "").split(maxsplit=1)
    if disk and disk[0].isdigit():
        free_gib = int(disk[0]) / (1 << 20)
        where = f"{disk[1] if len(disk) > 1 else '?'} ({facts.get('fs') or 'fs ?'})"
        verdict = "ok" if free_gib >= MIN_FREE_GIB else "warn"
        checks.append(Check("disk", verdict, f"{free_gib:.1f} GiB free at {where}"))

    checks.append(_compute_node(runner, facts.get("probe_dir") or host.workdir))

    try:
        offset = float(facts.get("time", "")) - (t0 + t1) / 2
        checks.append(Check("clock", "ok" if abs(offset) <= 5.0 + (t1 - t0) / 2 else "warn", f"offset {offset:+.2f} s"))
    except ValueError:
        checks.append(Check("clock", "warn", "remote date gave no reading"))
    return DoctorReport(host.name, checks, facts)


def _compute_node(runner: Runner, workdir: str) -> Check:
    """One task on one compute node of the partition: it must see the workdir (a shared file system) and import
    torch with the host's Python."""
    host = runner.host
    cluster = host.slurm
    argv = [
        "srun",
        "--nodes=1",
        "--ntasks=1",
        f"--immediate={SRUN_WAIT_S}",
        "--time=2",
        "--job-name=dflashctl-doctor",
        *([f"--partition={cluster.partition}"] if cluster.partition else []),
        *([f"--account={cluster.account}"] if cluster.account else []),
        "bash",
        "--noprofile",
        "--norc",
        "-c",
        NODE_SCRIPT,
        "doctor",
        workdir,
        host.python,
    ]
    res = runner.run(["bash", "--noprofile", "--norc", "-c", shlex.join(argv)], timeout=SRUN_WAIT_S + 90)
    facts = parse_facts(res.out)
    if res.returncode != 0 and not facts.get("node"):
        why = (res.err.strip().splitlines() or [f"srun exit status {res.returncode}"])[-1][:200]
        return Check("compute node", "fail", f"srun could not run a task: {why}", required=True)
    seen = facts.get("seen") == "1"
    torch = facts.get("torch", "none")
    detail = (
        f"{facts.get('node')}: "
        + (
            "sees the workdir"
            if seen
            else f"does not see {workdir}: the run dirs must be on a file system the compute nodes share"
        )
        + f", torch {torch}"
        + (f" (CUDA {facts['cuda']})" if facts.get("cuda") else "")
    )
    ok = seen and torch != "none"
    return Check("compute node", "ok" if ok else "fail", detail, required=True)
