"""How fast the CLI starts: `--help`, `ls`, `diagnose FILE` and `status` of a job on the `local` host, each a fresh
process, as a user types them; plus the interpreter alone for scale.

    .venv/bin/python bench/cli_start.py [--repeat 15]

Prints a table of median seconds; writes bench/results/cli-start.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import timed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cli-start-"))
    env = {**os.environ, "DFLASHCTL_STATE_DIR": str(work / "state"), "DFLASHCTL_TMUX_SOCKET": "dflashctl-bench"}
    exe = [sys.executable, "-m", "dflashctl"]

    def cli(*a: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([*exe, *a], cwd=ROOT, env=env, capture_output=True, text=True, check=check)

    hosts = work / "hosts.yaml"  # this machine, with a workdir of the benchmark's own
    hosts.write_text(f"hosts:\n  wd: {{python: {sys.executable}, workdir: {work / 'wd'}}}\n")
    env["DFLASHCTL_HOSTS"] = str(hosts)
    cli("deploy", "wd")
    (work / "job.yaml").write_text("name: bench\nhost: wd\ncommand: sleep 600\nkill_grace_s: 1\n")
    job_id = json.loads(cli("launch", str(work / "job.yaml"), "--json").stdout)["id"]
    log = ROOT / "tests" / "fixtures" / "logs" / "oom-plain.log"
    cases = {
        "python -c pass": lambda: subprocess.run([sys.executable, "-c", "pass"], check=True),
        "dflashctl --help": lambda: cli("--help"),
        "dflashctl ls": lambda: cli("ls"),
        "dflashctl diagnose FILE": lambda: cli("diagnose", str(log), check=False),
        "dflashctl status JOB (local host)": lambda: cli("status", job_id, check=False),
    }
    rows = {name: round(timed(fn, args.repeat), 3) for name, fn in cases.items()}
    cli("kill", job_id)
    print(f"| command | median s ({args.repeat} runs) |\n| --- | --- |")
    for name, s in rows.items():
        print(f"| `{name}` | {s:.3f} |")
    out = {
        "machine": platform.node(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "median_s": rows,
    }
    (ROOT / "bench" / "results" / "cli-start.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
