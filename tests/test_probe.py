"""probe.py: parsers on recorded H200 output, stdlib only, one remote command, GPUs read on a container's host."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from dflashctl.agent import probe
from dflashctl.config import HostConfig
from dflashctl.remote import session
from dflashctl.remote.agent_bundle import AGENT
from dflashctl.remote.ssh import SshRunner

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "nvidia-smi"


def test_gpu_rows_from_the_recorded_h200_query():
    (gpu,) = probe.parse_gpu_csv((FIXTURES / "h200-query-gpu-loaded.csv").read_text())
    assert gpu == {
        "index": 0, "uuid": "GPU-a9443500-8c84-a3d4-3c82-88edacab6d97", "name": "NVIDIA H200", "mem_used_mib": 21363,
        "mem_total_mib": 143771, "util_pct": 2, "power_w": 104.24, "temp_c": 37, "sm_mhz": 1980, "pstate": "P0",
        "throttle": "0x0000000000000000", "ecc_uncorrected": 0,
    }  # fmt: skip


def test_compute_apps_from_the_recorded_h200_query():
    (app,) = probe.parse_apps_csv((FIXTURES / "h200-query-compute-apps.csv").read_text())
    assert app == {"pid": 854, "name": "python3", "used_mib": 21354,
                   "gpu_uuid": "GPU-a9443500-8c84-a3d4-3c82-88edacab6d97"}  # fmt: skip
    assert probe.parse_apps_csv("No running processes found\n") == []


def test_probe_runs_on_a_bare_python_without_site_packages(tmp_path):
    """-I -S: no site-packages at all, as on a remote that has none of our dependencies."""
    (tmp_path / "train.log").write_text("line 1\nline 2\n")
    (tmp_path / "metrics.jsonl").write_text('{"time": 1, "step": 1}\n{"time": 2, "st')  # last line still being written
    req = f'{{"run_dir": "{tmp_path}", "log_offset": 7, "gpus": false}}'
    pyz = tmp_path / "agent.pyz"  # the zipapp as a file, as in a run dir: `python3 agent.pyz probe ...`
    pyz.write_bytes(AGENT)
    proc = subprocess.run([sys.executable, "-I", "-S", str(pyz), "probe", req], capture_output=True, check=True)
    import json

    snap = json.loads(proc.stdout)
    assert snap["log"]["text"] == "line 2\n" and snap["log"]["offset"] == 14
    assert snap["metrics"]["records"] == [{"time": 1, "step": 1}] and snap["metrics"]["offset"] == 23


def test_one_command_reads_gpus_on_the_container_host(client, sshd):
    for gpu_query, source in (("host", "host"), ("container", "nvidia-smi")):
        host = HostConfig(name="boxpct", ssh="testbox", container="pct:7", python=sys.executable, gpu_query=gpu_query)
        with SshRunner(host) as runner:
            before = runner.commands_run
            snap = session.call_agent(runner, {"gpus": True})
            assert runner.commands_run - before == 1
        assert snap["gpu"]["source"] == source
        assert snap["gpu"]["gpus"][0]["name"] == "NVIDIA H200" and snap["gpu"]["gpus"][0]["mem_total_mib"] == 143771
        assert snap["gpu"]["apps"][0]["pid"] == 854
