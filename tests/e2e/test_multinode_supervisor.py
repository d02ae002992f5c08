"""A job over two hosts keeps its own watch: one supervisor on the head that probes the other node by ssh from the
head (the suite's loopback sshd and keys, through an ssh config file on the head named by the job file's
`reach_ssh_config`), combines the nodes with judge/nodes.py, restarts both, and at the end closes every node's tmux
session and scrubs every node's secrets. A node the head cannot reach is said, and the laptop decides."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflashctl.agent import common
from tests.conftest import TEST_TMUX_SOCKET, run_cli
from tests.e2e.test_launch import cli_json_in, status_json, wait_until
from tests.e2e.test_multinode import TRAINER, two_hosts  # noqa: F401 - the fixture

ROOT = Path(__file__).resolve().parents[2]
SECRET = "hf_multinode_secret_9a8b7c"


def sessions() -> set[str]:
    res = subprocess.run(
        ["tmux", "-L", TEST_TMUX_SOCKET, "ls", "-F", "#{session_name}"], capture_output=True, text=True, check=False
    )
    return set(res.stdout.split())


def events(run_dir: str) -> list[dict]:
    path = Path(run_dir, "events.jsonl")
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def read_json(path: Path) -> dict:
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def deploy_both() -> None:
    """This tree deployed to both loopback nodes, as every test here needs."""
    for host in ("nodea", "nodeb"):
        assert run_cli("deploy", host, cwd=ROOT).code == 0


def head_ssh_config(tmp_path: Path, sshd, client) -> Path:
    """An ssh config file on the head (this machine) that reaches the suite's sshd: what a cluster's nodes share."""
    cfg = tmp_path / "head-ssh-config"
    cfg.write_text(
        f"Host testbox\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User root\n  IdentityFile "
        f"{sshd.user_key}\n  UserKnownHostsFile {client.known_hosts}\n"
    )
    cfg.chmod(0o600)
    return cfg


def test_a_node_the_head_cannot_reach_is_said_and_the_laptop_decides(two_hosts, tmp_path):  # noqa: F811
    """By default the head reaches node b at its HostName, port and user as the laptop resolves them, with the head's
    own keys and known_hosts: here the head's user has neither (BatchMode, StrictHostKeyChecking=yes: no prompt, no
    key taken on trust). The supervisor says so in verdict.json, and `status` decides here, naming the node."""
    deploy_both()
    job = tmp_path / "cmd.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "name": "mnunr",
                "host": ["nodea", "nodeb"],
                "kill_grace_s": 3,
                "command": "sleep 300",
                "watch": {"interval_s": 1},
            }
        )
    )
    rep = cli_json_in(ROOT, "launch", str(job))
    head, member = (Path(n["run_dir"]) for n in rep["nodes"])
    spec = json.loads((head / "supervise.json").read_text())
    (m,) = spec["members"]
    assert m["host"] == "nodeb" and m["run_dir"] == str(member) and m["session"] == rep["nodes"][1]["session"]
    assert m["reach"][:3] == ["ssh", "-o", "BatchMode=yes"] and m["reach"][-1] == "127.0.0.1"
    assert not (member / "supervise.json").exists(), "a supervisor on a member node too"
    said = wait_until(lambda: read_json(head / "verdict.json").get("unreached"), 60)
    assert said[0].startswith("nodeb: ssh from the head to nodeb:"), said
    st = wait_until(
        lambda: (lambda s: s if s["decided_by"] == "here" and "nodeb" in s["decided_why"] else None)(
            status_json(rep["id"], ROOT)
        ),
        60,
    )
    assert "the job's supervisor cannot reach nodeb" in st["decided_why"] and st["state"] == "RUNNING"
    assert any(e.get("decision") == "warning" and "cannot reach nodeb" in e.get("warning", "") for e in events(head))
    kill = cli_json_in(ROOT, "kill", rep["id"])
    assert kill["result"] == "KILLED" and kill["remaining"] == []
    assert not {n["session"] for n in rep["nodes"]} & sessions()


@pytest.mark.slow
def test_the_heads_supervisor_sees_node_b_crash_restarts_both_and_cleans_up_every_node(
    two_hosts,  # noqa: F811
    tmp_path,
    sshd,
    client,
):
    """No laptop watch at all: node b's rank crashes at step 5; the head's supervisor, probing node b by ssh from
    the head, names node b as CRASHED, restarts both nodes once (restart_on CRASHED, max_restarts 1), sees the job
    FINISHED on both, then closes both tmux sessions and scrubs the secret from both run dirs."""
    deploy_both()
    cfg = head_ssh_config(tmp_path, sshd, client)
    job = tmp_path / "mn.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "name": "mnsup",
                "hosts": [
                    {"host": "nodea"},
                    {
                        "host": "nodeb",
                        "env": {"TRAINER_FAULT": "crash@5"},
                        "reach": "testbox",
                        "reach_ssh_config": str(cfg),
                    },
                ],
                "nproc_per_node": 1,
                "env": {"OMP_NUM_THREADS": "1", "HF_TOKEN": SECRET},
                "kill_grace_s": 5,
                "trainer": TRAINER,
                "watch": {
                    "interval_s": 1,
                    "restart_on": ["CRASHED", "NCCL_TIMEOUT"],
                    "max_restarts": 1,
                    "backoff_s": 0,
                },
            }
        )
    )
    rep = cli_json_in(ROOT, "launch", str(job))
    head, member = (Path(n["run_dir"]) for n in rep["nodes"])
    st = wait_until(
        lambda: (lambda s: s if s["decided_by"] == "supervisor" else None)(status_json(rep["id"], ROOT)), 120
    )
    assert st["supervisor"]["answering"], st
    # a laptop watch attached from here on reads the supervisor's word and restarts nothing itself
    watch = subprocess.Popen(
        [sys.executable, "-m", "dflashctl", "watch", rep["id"], "--until-done", "--json"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ended = wait_until(lambda: read_json(head / "supervisor.json").get("ended"), 600)
    out, err = watch.communicate(timeout=300)
    polls = [json.loads(x) for x in out.splitlines()]
    assert watch.returncode == 0 and polls[-1]["state"] == "FINISHED", (err[-2000:], polls[-3:])
    restarted = [e for p in polls for e in p["events"] if e.get("decision") == "restart"]
    assert all(e["by"] != "watch" for e in restarted), restarted
    assert any(p["decided_by"] == "supervisor" for p in polls if p["state"] in ("RUNNING", "STARTING")), polls
    assert ended == "FINISHED", (ended, (head / "supervisor.log").read_text()[-2000:])
    got = events(head)
    crashed = [e for e in got if e.get("decision") == "state" and e.get("state") == "CRASHED"]
    assert crashed and crashed[0]["reason"].startswith("node nodeb:") and crashed[0]["by"] == "supervisor", got
    restarts = [e for e in got if e.get("decision") == "restart"]
    # the watch records what it saw restarted, as done elsewhere; it made none itself
    assert [e["attempt"] for e in restarts if e.get("by") == "supervisor"] == [1], restarts
    assert not [e for e in restarts if e.get("by") == "watch"], restarts
    assert [(p / common.RESTARTS).read_text().strip() for p in (head, member)] == ["1", "1"]
    starts = [
        r for r in map(json.loads, (head / "metrics.jsonl").read_text().splitlines()) if r.get("event") == "start"
    ]
    assert [s["resumed_from"] for s in starts] == [None, 4]  # both nodes resumed from their own checkpoint 4
    verdict = read_json(head / "verdict.json")
    assert verdict["state"] == "FINISHED" and [n["state"] for n in verdict["nodes"]] == ["FINISHED", "FINISHED"]
    assert verdict["unreached"] == []
    ends = [e for e in got if e.get("decision") == "node_end"]
    # node b's launcher scrubbed it at its clean end already (no restart could follow): nothing left to scrub
    assert [(e["node"], e["session_closed"]) for e in ends] == [("nodeb", True)], ends
    assert not {n["session"] for n in rep["nodes"]} & sessions(), "a tmux session of the job is left"
    for run in (head, member):
        assert SECRET not in (run / "job.env").read_text(errors="replace"), f"the secret stayed in {run}"
    st = status_json(rep["id"], ROOT)
    assert st["state"] == "FINISHED" and [n["state"] for n in st["nodes"]] == ["FINISHED", "FINISHED"]


def test_a_job_that_ends_for_good_leaves_no_session_and_no_secret_on_either_node(
    two_hosts,  # noqa: F811
    tmp_path,
    sshd,
    client,
):
    """Both nodes exit 1 (CRASHED, which the job's restart_on does not restart, though restarts are left: so no
    node's launcher scrubs by itself). The head's supervisor gives up, then on node b (by ssh from the head) and
    here scrubs the secret and closes the dead pane's session."""
    deploy_both()
    cfg = head_ssh_config(tmp_path, sshd, client)
    job = tmp_path / "end.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "name": "mnend",
                "hosts": [{"host": "nodea"}, {"host": "nodeb", "reach": "testbox", "reach_ssh_config": str(cfg)}],
                "env": {"HF_TOKEN": SECRET},
                "kill_grace_s": 3,
                "command": "sleep 2; echo giving up; exit 1",
                "watch": {"interval_s": 1, "restart_on": ["OOM"], "max_restarts": 1},
            }
        )
    )
    rep = cli_json_in(ROOT, "launch", str(job))
    head, member = (Path(n["run_dir"]) for n in rep["nodes"])
    ended = wait_until(lambda: read_json(head / "supervisor.json").get("ended"), 120)
    assert ended.startswith("CRASHED: CRASHED is not in the job's restart_on"), ended
    verdict = read_json(head / "verdict.json")
    # the head's crash decides at once: node b may still be in its last second (a loaded machine) or ended too
    states = [n["state"] for n in verdict["nodes"]]
    assert verdict["gave_up"] and states[0] == "CRASHED" and states[1] in ("CRASHED", "RUNNING"), verdict
    ends = [e for e in events(head) if e.get("decision") == "node_end"]
    assert [(e["node"], e["scrubbed"], e["session_closed"]) for e in ends] == [("nodeb", ["HF_TOKEN"], True)], ends
    assert not {n["session"] for n in rep["nodes"]} & sessions(), "a tmux session of the job is left"
    for run in (head, member):
        assert SECRET not in (run / "job.env").read_text(errors="replace"), f"the secret stayed in {run}"
    st = status_json(rep["id"], ROOT)
    assert st["state"] == "CRASHED" and st["gave_up"] and [n["state"] for n in st["nodes"]] == ["CRASHED", "CRASHED"]


@pytest.mark.parametrize(
    ("node", "expect"),
    [
        ({"reach": "nodeb;touch /tmp/x"}, "hosts.1.reach: expected an ssh destination"),
        ({"reach": "-oProxyCommand=x"}, "hosts.1.reach: expected an ssh destination"),
        ({"reach_ssh_config": "relative/config"}, "hosts.1.reach_ssh_config: expected an absolute path"),
    ],
)
def test_a_bad_reach_is_one_line_exit_2_and_nothing_starts(two_hosts, tmp_path, node, expect):  # noqa: F811
    job = tmp_path / "bad.yaml"
    job.write_text(
        yaml.safe_dump({"name": "mnbad", "hosts": [{"host": "nodea"}, {"host": "nodeb", **node}], "command": "sleep 1"})
    )
    res = run_cli("launch", str(job), cwd=ROOT)
    assert res.code == 2 and expect in res.stderr and len(res.stderr.splitlines()) == 1, res.stderr
    assert str(job) in res.stderr
    assert not list(two_hosts.glob("*/runs/mnbad-*")), "something started"


def test_node_b_lost_from_the_head_and_found_again_then_the_supervisor_frozen(
    two_hosts,  # noqa: F811
    tmp_path,
    sshd,
    client,
):
    """Mid-run the head loses its way to node b (its ssh config file is moved away: ssh exits 255): the verdict says
    node b is not reached and `status` decides here; the file back, the supervisor's word is the job's again. Then the
    head's supervisor is frozen (SIGSTOP): its heartbeat stops, and `status` decides here again, saying why."""
    deploy_both()
    cfg = head_ssh_config(tmp_path, sshd, client)
    job = tmp_path / "lost.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "name": "mnlost",
                "hosts": [{"host": "nodea"}, {"host": "nodeb", "reach": "testbox", "reach_ssh_config": str(cfg)}],
                "kill_grace_s": 3,
                "command": "sleep 300",
                "watch": {"interval_s": 1},
            }
        )
    )
    rep = cli_json_in(ROOT, "launch", str(job))
    head = Path(rep["nodes"][0]["run_dir"])

    def verdict_where(test):
        return lambda: (lambda v: v if v and test(v) else None)(read_json(head / "verdict.json"))

    def status_where(test):
        return lambda: (lambda s: s if test(s) else None)(status_json(rep["id"], ROOT))

    v = wait_until(verdict_where(lambda v: v.get("state") == "RUNNING" and len(v.get("nodes", [])) == 2), 60)
    assert v["unreached"] == [] and [n["host"] for n in v["nodes"]] == ["nodea", "nodeb"]
    st = wait_until(status_where(lambda s: s["decided_by"] == "supervisor"), 60)
    assert st["state"] == "RUNNING" and [n["state"] for n in st["nodes"]] == ["RUNNING", "RUNNING"]
    away = cfg.rename(tmp_path / "moved-away")
    v = wait_until(verdict_where(lambda v: v.get("unreached")), 60)
    assert v["unreached"][0].startswith("nodeb: ssh from the head to nodeb:"), v
    st = wait_until(status_where(lambda s: s["decided_by"] == "here"), 60)
    assert "the job's supervisor cannot reach nodeb" in st["decided_why"] and st["state"] == "RUNNING"
    away.rename(cfg)
    wait_until(verdict_where(lambda v: v.get("unreached") == [] and len(v.get("nodes", [])) == 2), 60)
    wait_until(status_where(lambda s: s["decided_by"] == "supervisor"), 60)
    said = [e["warning"] for e in events(head) if e.get("decision") == "warning"]
    assert any("cannot reach nodeb" in w for w in said) and said[-1] == "every node is reached again", said
    pid = read_json(head / "supervisor.json")["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        st = wait_until(status_where(lambda s: s["decided_by"] == "here"), 90)
        assert "the job's supervisor is not answering" in st["decided_why"], st
    finally:
        os.kill(pid, signal.SIGCONT)
    kill = cli_json_in(ROOT, "kill", rep["id"])
    assert kill["result"] == "KILLED" and kill["remaining"] == []
    assert not {n["session"] for n in rep["nodes"]} & sessions()


def test_without_a_supervisor_status_scrubs_every_node_once_the_job_ended_for_good(two_hosts, tmp_path):  # noqa: F811
    """`supervise: false`: both nodes exit 1, a failure the job's restart_on does not name, with restarts left (so
    no launcher scrubs by itself). No supervise.json anywhere; the first `status` that judges the job ended for good
    has the secret scrubbed from every node's run dir, not only the head's."""
    deploy_both()
    job = tmp_path / "nosup.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "name": "mnnosup",
                "host": ["nodea", "nodeb"],
                "env": {"HF_TOKEN": SECRET},
                "kill_grace_s": 3,
                "command": "exit 1",
                "watch": {"supervise": False, "restart_on": ["OOM"], "max_restarts": 1},
            }
        )
    )
    rep = cli_json_in(ROOT, "launch", str(job))
    runs = [Path(n["run_dir"]) for n in rep["nodes"]]
    assert not [r for r in runs if (r / "supervise.json").exists()]
    wait_until(lambda: all((r / "exit_code").exists() for r in runs), 60)
    assert all(SECRET in (r / "job.env").read_text(errors="replace") for r in runs)  # at rest until judged
    st = wait_until(lambda: (lambda s: s if s["state"] == "CRASHED" else None)(status_json(rep["id"], ROOT)), 60)
    assert st["decided_by"] == "here" and [n["state"] for n in st["nodes"]] == ["CRASHED", "CRASHED"]
    for run in runs:
        assert SECRET not in (run / "job.env").read_text(errors="replace"), f"the secret stayed in {run}"
