"""doctor over the real sshd, with the fake nvidia-smi answering from recorded H200 output."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dflashctl.remote.doctor import parse_gpu_csv

FIXTURES = Path(__file__).parents[1] / "fixtures" / "nvidia-smi"


def test_parse_recorded_gpu_csv():
    line = (FIXTURES / "h200-query-gpu-loaded.csv").read_text().split(", ")
    assert parse_gpu_csv(f"{line[0]}, {line[2]}, {line[4]}, {line[-1].strip()}\n") == [
        {"index": 0, "name": "NVIDIA H200", "memory_mib": 143771, "ecc_uncorrected": 0}
    ]
    assert parse_gpu_csv("0, NVIDIA H200, 143771, [N/A]\n")[0]["ecc_uncorrected"] is None
    assert parse_gpu_csv("No devices were found\n") == []


def checks_of(stdout: str) -> dict:
    return {c["name"]: c for c in json.loads(stdout)["checks"]}


def test_doctor_over_ssh_in_container(cli, client, sshd):
    client.write_hosts("hosts:\n  box:\n    ssh: testbox\n    container: pct:202\n    gpu_query: host\n")
    res = cli("doctor", "box", "--json")
    assert res.code == 0, res.stderr
    checks = checks_of(res.stdout)
    assert checks["container exec"]["status"] == "ok"
    assert checks["python"]["status"] == "ok" and checks["tmux"]["status"] == "ok"
    assert checks["gpus"]["status"] == "ok" and "NVIDIA H200 140 GiB" in checks["gpus"]["detail"]
    assert checks["clock"]["status"] == "ok"


def test_doctor_fails_when_container_is_missing(cli, client):
    client.write_hosts("hosts:\n  box:\n    ssh: testbox\n    container: docker:nosuch\n")
    res = cli("doctor", "box", "--json")
    checks = checks_of(res.stdout)
    assert res.code == 1 and checks["container exec"]["status"] == "fail"


def test_doctor_table_for_people(cli, client):
    res = cli("doctor", "testbox")
    assert res.code == 0 and "tmux" in res.stdout and "reachable" in res.stdout


def test_one_interpreter_says_python_torch_and_nccl_and_a_missing_torch_leaves_its_facts_empty(tmp_path):
    """The facts script asks the host's Python once for its version, torch's and NCCL's (torch imported once, not
    twice); a Python without torch still gives its version, and the torch and NCCL facts read as absent."""
    import subprocess
    import sys

    from dflashctl.remote.doctor import FACTS_SCRIPT, parse_facts

    bare = tmp_path / "python-without-site"  # this Python without site-packages: no torch there
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    seen = {}
    for py in (sys.executable, str(bare), str(tmp_path / "no-such-python")):
        out = subprocess.run(
            ["bash", "-c", FACTS_SCRIPT, "facts", str(tmp_path), py], capture_output=True, text=True, timeout=120
        ).stdout
        facts = parse_facts(out)
        seen[py] = (facts.get("python", ""), facts.get("torch", ""), facts.get("nccl", ""), "tmux" in facts)
    version = sys.version.split()[0]
    import torch

    assert seen[sys.executable][0] == version and seen[sys.executable][1].startswith(torch.__version__)
    assert seen[str(bare)] == (version, "", "", True)
    assert seen[str(tmp_path / "no-such-python")] == ("", "", "", True)


def test_an_unreachable_host_gets_its_table_and_the_one_json_schema(cli, client):
    from tests.conftest import free_port

    client.write_hosts(f"hosts:\n  gone:\n    ssh: root@127.0.0.1\n    port: {free_port()}\n    connect_timeout: 2\n")
    res = cli("doctor", "gone")
    assert res.code == 1 and "reachable" in res.stdout and "cannot connect" in res.stdout
    res = cli("doctor", "gone", "--json")
    got = json.loads(res.stdout)
    assert res.code == 1 and set(got) == {"ok", "host", "checks", "reports"} and got["ok"] is False
    assert got["checks"][0]["name"] == "reachable" and got["checks"][0]["status"] == "fail"
    ok = json.loads(cli("doctor", "testbox", "--json").stdout)
    assert set(ok) == set(got) and ok["reports"][0]["checks"] == ok["checks"]  # the same schema either way


def test_the_local_host_has_no_clock_offset_to_itself(cli, client):
    checks = checks_of(cli("doctor", "local", "--json").stdout)
    assert checks["clock"]["status"] == "ok" and "offset" not in checks["clock"]["detail"]


def _path_without_nvidia_smi(extra: Path | None = None) -> str:
    dirs = [d for d in os.environ["PATH"].split(os.pathsep) if d and not (Path(d) / "nvidia-smi").exists()]
    return os.pathsep.join([*([str(extra)] if extra else []), *dirs])


@pytest.mark.parametrize(
    "fake, says",
    [
        (None, "nvidia-smi is not installed on local: no GPU can be seen"),
        ("echo 'No devices were found'; exit 6", "nvidia-smi found no GPU on local"),
        (
            'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."; exit 9',
            "nvidia-smi failed on local (exit 9: NVIDIA-SMI has failed because it couldn't communicate",
        ),
    ],
)
def test_no_gpu_says_why_nvidia_smi_missing_failing_or_finding_none(cli, client, tmp_path, fake, says):
    """`nvidia-smi found no GPU` was said when nvidia-smi was not even installed."""
    bin_dir = None
    if fake is not None:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\n{fake}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    res = cli("doctor", "local", "--json", env={"PATH": _path_without_nvidia_smi(bin_dir)})
    gpus = checks_of(res.stdout)["gpus"]
    assert gpus["status"] == "warn" and says in gpus["detail"], gpus
    assert fake is None or "not installed" not in gpus["detail"]
