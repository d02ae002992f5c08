"""probe.py: parsers on recorded H200 output, stdlib only, one remote command, GPUs read on a container's host."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from dflashctl.agent import gpus, starting
from dflashctl.config import HostConfig
from dflashctl.remote import session
from dflashctl.remote.agent_bundle import AGENT
from dflashctl.remote.ssh import SshRunner

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi"


def test_gpu_rows_from_the_recorded_h200_query():
    (gpu,) = gpus.parse_gpu_csv((FIXTURES / "h200-query-gpu-loaded.csv").read_text())
    assert gpu == {
        "index": 0,
        "uuid": "GPU-a9443500-8c84-a3d4-3c82-88edacab6d97",
        "name": "NVIDIA H200",
        "mem_used_mib": 21363,
        "mem_total_mib": 143771,
        "util_pct": 2,
        "power_w": 104.24,
        "temp_c": 37,
        "sm_mhz": 1980,
        "pstate": "P0",
        "throttle": "0x0000000000000000",
        "ecc_uncorrected": 0,
    }


def test_compute_apps_from_the_recorded_h200_query():
    (app,) = gpus.parse_apps_csv((FIXTURES / "h200-query-compute-apps.csv").read_text())
    assert app == {
        "pid": 854,
        "name": "python3",
        "used_mib": 21354,
        "gpu_uuid": "GPU-a9443500-8c84-a3d4-3c82-88edacab6d97",
    }
    assert gpus.parse_apps_csv("No running processes found\n") == []


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


def test_a_launchs_torch_check_is_kept_until_the_interpreter_or_torch_changes(tmp_path, monkeypatch):
    """`import torch` at every launch costs seconds: a success is kept (0600, beside the agent) and reused while the
    interpreter, torch's files, the boot and the driver are the same; a reinstall of torch, a failure, a garbage
    or group-writable cache are each checked again. A stand-in torch package lets the test change its files."""
    import json
    import os

    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    (fake / "version.py").write_text("__version__ = '9.9.0'\n")
    init = (
        "from torch.version import __version__\nclass cuda:\n    is_available = staticmethod(lambda: False)\n"
        "    device_count = staticmethod(lambda: 0)\n"
    )
    (fake / "__init__.py").write_text(init)
    calls = tmp_path / "calls"
    py = tmp_path / "python"  # the job's Python: this one, seeing the stand-in, counting its `import torch`
    py.write_text(
        f'#!/bin/sh\ncase "$2" in "import torch;"*) echo x >> {calls};; esac\n'
        f'PYTHONPATH={fake.parent} exec {sys.executable} -S "$@"\n'
    )
    py.chmod(0o755)
    home = tmp_path / "agent-home"
    home.mkdir(mode=0o700)
    monkeypatch.setattr(sys, "argv", [str(home / "agent-x.pyz")])

    def imports() -> int:
        return len(calls.read_text().splitlines()) if calls.exists() else 0

    assert starting.torch_check(str(py)) == (0, "9.9.0 0 0\n") and imports() == 1
    cache = home / starting.TORCH_CACHE
    assert oct(cache.stat().st_mode & 0o777) == "0o600"
    assert starting.torch_check(str(py))[0] == 0 and imports() == 1  # kept
    (fake / "version.py").write_text("__version__ = '9.9.1'\n")  # a reinstall replaces torch's files
    assert starting.torch_check(str(py)) == (0, "9.9.1 0 0\n") and imports() == 2
    cache.write_text("[not a dict")
    assert starting.torch_check(str(py))[0] == 0 and imports() == 3 and json.loads(cache.read_text())
    os.chmod(cache, 0o666)  # others may write it: not believed
    assert starting.torch_check(str(py))[0] == 0 and imports() == 4
    (fake / "__init__.py").write_text("raise ImportError('libcudart.so.13: cannot open shared object file')\n")
    (fake / "version.py").write_text("__version__ = '9.9.2'\n")
    assert starting.torch_check(str(py))[0] != 0 and starting.torch_check(str(py))[0] != 0
    assert imports() == 6  # never kept


def test_the_agent_copies_itself_byte_for_byte_from_the_bytes_it_was_sent(tmp_path):
    """Run by BOOT from memory, the agent's own archive (what a launch writes as RUN/agent.pyz) is the very bytes
    that were checked."""
    import json
    import os

    from dflashctl.remote.agent_bundle import AGENT, boot_argv

    env = {"HOME": str(tmp_path), "PATH": os.environ["PATH"]}
    code = "from dflashctl.agent.pack import own_archive; import sys; sys.stdout.buffer.write(own_archive())"
    argv = boot_argv(sys.executable, "probe", json.dumps({"run_dir": str(tmp_path), "gpus": False}))
    i = argv.index("-c") + 1  # the boot line
    got = subprocess.run(
        [
            *argv[:i],
            argv[i].replace("from dflashctl.agent.__main__ import main\nsys.exit(main())", code),
            *argv[i + 1 :],
        ],
        input=AGENT,
        capture_output=True,
        env=env,
        timeout=60,
    )
    assert got.returncode == 0, got.stderr
    assert got.stdout == AGENT


def test_the_fake_nvidia_smi_never_reports_a_recorded_pid_that_is_now_another_program(tmp_path):
    """Pids wrap over a long suite: a job's `sleep` may get the recorded GPU process's pid. The real nvidia-smi lists
    only processes that hold a GPU, so the fake leaves out a recorded pid that is now another program."""
    import os

    fake = Path(__file__).resolve().parents[1] / "fakes" / "nvidia-smi"
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        rows = tmp_path / "apps.csv"
        rows.write_text(
            f"{sleeper.pid}, python3, 100, GPU-x\n{sleeper.pid}, sleep, 100, GPU-x\n999999, python3, 5, GPU-y\n"
        )
        out = subprocess.run(
            [str(fake), "--query-compute-apps=pid,process_name,used_memory,gpu_uuid", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "FAKE_NVIDIA_SMI_APPS": str(rows)},
        ).stdout
        assert out.splitlines() == [f"{sleeper.pid}, sleep, 100, GPU-x", "999999, python3, 5, GPU-y"]
    finally:
        sleeper.kill()
