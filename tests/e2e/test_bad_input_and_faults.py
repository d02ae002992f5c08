"""Garbage in, faults midway, two at once: input edges, known_hosts, the probe and watcher on malformed files, and
deploys that fail halfway or race. Cases of docs/reliability.md."""

from __future__ import annotations

import functools
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

from dflashctl.agent.common import locked
from dflashctl.agent.snapshot import snapshot as take_snapshot
from dflashctl.jobs.watch import Watcher
from dflashctl.judge.assess import assess
from dflashctl.model.jobfile import WatchConfig
from dflashctl.model.record import JobRecord
from dflashctl.remote import sync
from dflashctl.remote.agent_bundle import AGENT, AGENT_SHA, boot_argv
from tests.conftest import run_cli, tmpfs

# --------------------------------------------------------------------------------------------- input edges

BAD_JOB_FILES = [
    (b'name: "fz\\n"\nhost: box\ncommand: echo hi\n', "name: may hold only"),
    (b"name: j\nname: k\nhost: box\ncommand: echo hi\n", "duplicate key 'name'"),
    (b"\x00\x01\x02binary\xff\xfe", "not UTF-8"),
    ("name: caf\u00e9\n".encode("latin-1"), "not UTF-8"),
    (b"name: j\nhost: box\ncommand: echo hi\nenv: " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested deeper"),
    (b"name: j\nhost: box\ngpus: 200000000\ncommand: echo hi\n", "gpus: "),
    (b"name: j\nhost: box\ngpus: [0, 99999999]\ncommand: echo hi\n", "gpus: "),
    (b"name: j\nhost: box\ncommand: echo hi\nwatch: {interval_s: .inf}\n", "watch.interval_s"),
    (b"name: j\nhost: box\ncommand: echo hi\nwatch: {stall_after_s: .nan}\n", "watch.stall_after_s"),
    (b"name: j\nhost: box\ncommand: echo hi\nenv: {'A\\n': x}\n", "env"),
    (b"name: j\nhost: 'box\\n'\ncommand: echo hi\n", "host: expected a host name"),
]


@pytest.mark.parametrize("body, expect", BAD_JOB_FILES)
def test_garbage_job_files_are_one_line_exit_2_and_touch_nothing(client, body, expect):
    (client.project / "dflashctl.yaml").write_text("hosts:\n  box: {ssh: 'root@192.0.2.1', connect_timeout: 30}\n")
    (client.project / "bad.yaml").write_bytes(body)
    res = run_cli("launch", "bad.yaml", cwd=client.project, timeout=60)
    lines = res.stderr.strip().splitlines()
    assert res.code == 2 and len(lines) == 1 and "bad.yaml" in lines[0] and expect in lines[0], lines
    assert "internal error" not in res.stderr and "192.0.2.1" not in res.stderr


@pytest.mark.parametrize("spec", ["pct:7\n", "docker:x\n"])
def test_container_and_hosts_patterns_use_fullmatch(client, spec):
    (client.project / "dflashctl.yaml").write_text(f"hosts:\n  b: {{ssh: testbox, container: {json.dumps(spec)}}}\n")
    res = run_cli("deploy", "b", cwd=client.project)
    assert res.code == 2 and "container" in res.stderr


@pytest.mark.parametrize("files", ["null", "[1, 2]", '{"a.py": null}', '"text"'])
def test_a_malformed_remote_manifest_reads_as_empty(files):
    assert sync.parse_remote_manifest(f'{{"version": "x", "files": {files}}}') == {}


def test_known_hosts_lines_behave_as_in_openssh(client, sshd):
    """@cert-authority and unparseable lines are skipped; a host key marked @revoked is refused (exit 2)."""
    (client.project / "a.py").write_text("A = 1\n")
    good = client.known_hosts.read_text()
    junk = "@cert-authority *.example.com ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIJunk\nnot a key line at all\n|1|x|y\n"
    client.known_hosts.write_text(junk + good)
    assert run_cli("doctor", "testbox", "--json").code in (0, 1)  # connected: doctor judged the host
    client.known_hosts.write_text(good + f"@revoked [127.0.0.1]:{sshd.port} {sshd.host_pubkey}\n")
    res = run_cli("deploy", "testbox", "--workdir", "/tmp/never")
    assert res.code == 2 and "@revoked" in res.stderr and "SHA256:" in res.stderr
    assert not Path("/tmp/never").exists()


# --------------------------------------------------------------------------------------------- probe garbage


def make_watcher(job_id: str = "j", **watch) -> Watcher:
    rec = JobRecord(
        id=job_id,
        name="j",
        project="/p",
        job_file="/p/j.yaml",
        host_name="h",
        host={"name": "h"},
        release="r",
        command="c",
        run_dir="/r",
        session="s",
        launched_at=0.0,
        watch=WatchConfig(**watch),
    )
    return Watcher(rec, rec.watch, lambda: None)


def snapshot(run: Path) -> dict:
    return take_snapshot({"run_dir": str(run), "gpus": False})


def test_malformed_metrics_and_heartbeats_are_skipped_and_counted(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    now = time.time()
    lines = [
        "[1, 2, 3]",
        "42",
        '"a string"',
        "null",
        "{not json",
        json.dumps({"time": now, "step": 1, "loss": "high", "tokens_per_s": 100}),
        json.dumps({"time": now, "step": "two", "loss": 1.0}),
        json.dumps({"time": now, "step": 3, "loss": 2.5}),  # no tokens_per_s
        json.dumps({"time": now, "step": 4, "loss": 2.0, "tokens_per_s": [1]}),
        json.dumps({"event": "eval", "tau": "great"}),
    ]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    for hb in ("null", "[1, 2]", '{"time": "noon", "step": 3}', '"x"', "{"):
        (run / "heartbeat").write_text(hb)
        w = make_watcher()
        snap = snapshot(run)
        w.judge.take(snap)
        w.history.session_exists, w.history.started_at = True, now - 10
        v = assess(w.history, w.judge.th)
        assert v.state == "RUNNING" and w.history.last_step == 4 and w.tau is None, (hb, v)
        assert snap["metrics"]["malformed"] == 5 and w.history.malformed >= 6
        assert any("malformed" in e for e in v.evidence)


def test_a_heartbeat_from_the_future_cannot_keep_a_frozen_job_running(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "heartbeat").write_text(json.dumps({"time": time.time(), "step": 5, "phase": "train"}))
    future = time.time() + 3600
    os.utime(run / "heartbeat", (future, future))
    w = make_watcher(heartbeat_max_age_s=1)
    states = []
    for _ in range(3):
        snap = snapshot(run)
        assert snap["heartbeat"]["future"] and snap["heartbeat"]["age_s"] is None
        w.judge.take(snap)
        w.history.session_exists, w.history.started_at = True, time.time() - 5
        states.append(assess(w.history, w.judge.th).state)
        time.sleep(0.7)
    assert states[0] != "STALLED" and states[-1] == "STALLED", states


def test_probe_answers_for_a_job_whose_files_are_garbage(tmp_path):
    """Through the real bootstrap on a bare interpreter: exit 0 with JSON, whatever the run dir holds."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(b"\xff\xfe\x00garbage\n[1]\n")
    (run / "heartbeat").write_bytes(b"\x00\x01")
    (run / "exit_code").write_text("not a number")
    (run / "stop_request").write_text("[]")
    req = json.dumps({"run_dir": str(run), "gpus": False})
    argv = boot_argv(sys.executable, "probe", req)
    proc = subprocess.run([argv[0], "-I", "-S", *argv[1:]], input=AGENT, capture_output=True, check=True)
    snap = json.loads(proc.stdout)
    assert snap["exit_code"] is None and snap["metrics"]["malformed"] == 2 and snap["heartbeat"]["malformed"]
    assert snap["stop_request"] == {"time": None}  # present, unreadable: still a stop request


# --------------------------------------------------------------------------------------------- releases


def run_agent(wd: Path, req: dict, stream: bytes, umask: int | None = None) -> dict:
    argv = boot_argv(sys.executable, "release", json.dumps({"workdir": str(wd), **req}))
    preexec = None if umask is None else functools.partial(os.umask, umask)
    proc = subprocess.run(argv, input=AGENT + stream, capture_output=True, preexec_fn=preexec)
    return json.loads(proc.stdout)


def tar_of(root: Path, files: list[str]) -> tuple[bytes, str]:
    manifest = sync.build_manifest(root, files, cache=False)
    stream, _ = sync.build_tar(root, files, manifest)
    return stream.read(), sync.manifest_version(manifest)


def tree(code: Path) -> dict[str, bytes]:
    return {
        p.relative_to(code).as_posix(): p.read_bytes()
        for p in sorted(code.rglob("*"))
        if p.is_file() and p.name != sync.MANIFEST_NAME
    }


def test_an_interrupted_stream_leaves_the_previous_release_current(tmp_path):
    src, wd = tmp_path / "src", tmp_path / "wd"
    src.mkdir()
    (src / "a.py").write_text("A = 1\n")
    data, v1 = tar_of(src, ["a.py"])
    assert run_agent(wd, {"version": v1, "base": None}, data)["ok"]
    (src / "a.py").write_text("A = 2\n" * 10000)
    data, v2 = tar_of(src, ["a.py"])
    in_manifest = data.index(b'{"version"') + 20  # the manifest is the last member: cut inside it
    for cut in (100, 600, len(data) // 2, in_manifest):
        ans = run_agent(wd, {"version": v2, "base": v1}, data[:cut])
        assert not ans["ok"], cut
        assert os.readlink(wd / "code") == f"releases/{v1}" and tree(wd / "code") == {"a.py": b"A = 1\n"}
    assert run_agent(wd, {"version": v2, "base": v1}, data)["ok"]
    assert not [d for d in os.listdir(wd / "releases") if d.startswith(".staging")]  # leftovers collected


def test_a_corrupt_stream_fails_verification(tmp_path):
    src, wd = tmp_path / "src", tmp_path / "wd"
    src.mkdir()
    (src / "a.py").write_text("A = 1\n")
    manifest = sync.build_manifest(src, ["a.py"])
    (src / "a.py").write_text("B = 2\n")  # same size, other bytes: the manifest no longer matches the content
    stream, _ = sync.build_tar(src, ["a.py"], manifest)
    ans = run_agent(wd, {"version": sync.manifest_version(manifest), "base": None}, stream.read())
    assert not ans["ok"] and "verification failed" in ans["error"] and not (wd / "code").exists()


def test_a_release_of_many_files_in_many_directories_is_exact_under_any_umask(tmp_path):
    """The agent writes small files on several threads and large ones as they stream: every byte, every mode (the
    bits a umask would take away included) and every symlink lands, and the release verifies."""
    src, wd = tmp_path / "src", tmp_path / "wd"
    files = []
    for d in range(7):
        for i in range(40):
            rel = f"pkg{d}/sub{i % 3}/m{i}.py"
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes(os.urandom(i * 97))  # empty files too
            os.chmod(src / rel, [0o644, 0o755, 0o600, 0o666, 0o777][i % 5])
            files.append(rel)
    (src / "big.bin").write_bytes(os.urandom((4 << 20) + 12345))  # past what a writer is handed in memory
    os.chmod(src / "big.bin", 0o664)
    (src / "pkg0" / "link.py").symlink_to("sub0/m0.py")
    files += ["big.bin", "pkg0/link.py"]
    data, version = tar_of(src, files)
    ans = run_agent(wd, {"version": version, "base": None}, data, umask=0o077)
    assert ans["ok"], ans
    code = wd / "code"
    assert tree(code) == tree(src)
    for rel in files[:-1]:
        assert (code / rel).stat().st_mode & 0o777 == (src / rel).stat().st_mode & 0o777, rel
    assert os.readlink(code / "pkg0" / "link.py") == "sub0/m0.py"


def test_a_writer_that_fails_midway_fails_the_release_and_leaves_nothing(tmp_path):
    """A file the stream names twice makes one writer's create fail while the others still have files queued: the
    release fails with that error, the previous release stays current, and no staging dir is left behind (every
    writer has stopped before it is removed)."""
    src, wd = tmp_path / "src", tmp_path / "wd"
    src.mkdir()
    (src / "a.py").write_text("A = 1\n")
    data, v1 = tar_of(src, ["a.py"])
    assert run_agent(wd, {"version": v1, "base": None}, data)["ok"]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for i in range(300):
            name = "dup.py" if i in (100, 101) else f"d{i % 9}/f{i}.py"
            info = tarfile.TarInfo(name)
            info.size, info.mode = 4096, 0o644
            tar.addfile(info, io.BytesIO(os.urandom(4096)))
    ans = run_agent(wd, {"version": "v" * 64, "base": v1}, buf.getvalue())
    assert not ans["ok"] and "File exists" in ans["error"] and "dup.py" in ans["error"], ans
    assert os.readlink(wd / "code") == f"releases/{v1}" and tree(wd / "code") == {"a.py": b"A = 1\n"}
    assert sorted(os.listdir(wd / "releases")) == [v1]


def test_the_stream_interleaves_directories_and_keeps_every_file_once():
    files = [f"a/{i}.py" for i in range(5)] + ["b/x.py", "b/y.py"] + ["top.py"] + [f"a/s/{i}" for i in range(3)]
    order = sync.across_directories(files)
    assert sorted(order) == sorted(files)
    parents = [rel.rpartition("/")[0] for rel in order]
    assert all(p != q for p, q in zip(parents[:4], parents[1:5], strict=True))  # four dirs: round one alternates
    assert [rel for rel in order if rel.startswith("a/") and "/s/" not in rel] == files[:5]  # order kept per dir


@pytest.fixture
def small_disk(tmp_path):
    with tmpfs(tmp_path / "small", "256k") as mnt:
        yield mnt


def test_a_full_disk_fails_the_deploy_and_keeps_the_previous_release(cli, client, small_disk):
    root = client.project
    (root / "a.py").write_text("A = 1\n")
    wd = small_disk / "wd"
    assert cli("deploy", "testbox", "--workdir", str(wd)).code == 0
    before = tree(wd / "code")
    (root / "big.bin").write_bytes(os.urandom(400 << 10))
    res = cli("deploy", "testbox", "--workdir", str(wd))
    assert res.code == 1 and "No space left" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert "None" not in res.stderr
    assert tree(wd / "code") == before
    assert not [d for d in os.listdir(wd / "releases") if d.startswith(".staging")]


def test_concurrent_deploys_of_different_checkouts_leave_a_true_manifest(cli, client, tmp_path):
    wd = tmp_path / "wd"
    roots = []
    for k in range(2):
        r = tmp_path / f"co{k}"
        (r / "pkg").mkdir(parents=True)
        for i in range(30):
            (r / "pkg" / f"m{i}.py").write_text(f"X = {k}{i}\n" * 50)
        roots.append(r)
    for _ in range(3):
        results: list = [None, None]

        def go(k: int, results=results) -> None:
            results[k] = run_cli("deploy", "testbox", "--workdir", str(wd), "--json", cwd=roots[k])

        threads = [threading.Thread(target=go, args=(k,)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r.code for r in results] == [0, 0], [r.stderr for r in results]
        code = wd / "code"
        manifest = json.loads((code / sync.MANIFEST_NAME).read_text())
        assert os.readlink(code) == f"releases/{manifest['version']}"
        winner = next(r for r in roots if sync.manifest_version(sync.build_manifest(r)) == manifest["version"])
        assert tree(code) == tree(winner)


def test_deploy_selection_edges(cli, client, tmp_path):
    """A file that becomes a directory and back, tracked files under junk-looking names, symlinks in and out of the
    tree, and a non-UTF-8 file name deployed and then deleted."""
    root = client.project
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / "build").mkdir()
    (root / "build" / "gen.py").write_text("tracked under build/\n")
    (root / "notes~").write_text("tracked backup-looking file\n")
    (root / "x").write_text("a file\n")
    (root / "link.py").symlink_to("x")
    weird = os.fsdecode(b"caf\xe9.txt")
    (root / weird).write_text("latin-1 name\n")
    subprocess.run(["git", "-C", str(root), "add", "-A"], check=True)
    (root / "dist").mkdir()
    (root / "dist" / "junk.whl").write_text("untracked junk\n")
    wd = tmp_path / "wd"

    def deploy() -> dict:
        res = cli("deploy", "testbox", "--workdir", str(wd), "--json")
        assert res.code == 0, res.stderr
        return json.loads(res.stdout)

    deploy()
    code = wd / "code"
    assert (code / "build" / "gen.py").is_file() and (code / "notes~").is_file() and not (code / "dist").exists()
    assert os.readlink(code / "link.py") == "x" and (code / weird).is_file()
    (root / "x").unlink()
    (root / "x").mkdir()
    (root / "x" / "inner.py").write_text("now a directory\n")
    (root / weird).unlink()
    deploy()
    assert (code / "x" / "inner.py").is_file() and not (code / weird).exists()
    (root / "out.cfg").symlink_to(Path.home() / ".ssh" / "config")
    before = (os.readlink(code), sorted(os.listdir(wd / "releases")))
    res = cli("deploy", "testbox", "--workdir", str(wd))  # the ssh handshake runs meanwhile; no command does
    assert res.code == 2 and "out.cfg" in res.stderr and "outside the project" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert (os.readlink(code), sorted(os.listdir(wd / "releases"))) == before


def test_tar_member_paths_are_checked(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../escape.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    ans = run_agent(tmp_path / "wd", {"version": "v", "base": None}, buf.getvalue())
    assert not ans["ok"] and "unsafe path" in ans["error"] and not (tmp_path / "escape.txt").exists()


def test_releases_no_live_job_uses_are_collected(tmp_path):
    """The current release, those a live run uses, and the newest few stay; the rest go."""
    src, wd = tmp_path / "src", tmp_path / "wd"
    src.mkdir()
    versions = []
    for i in range(7):
        (src / "a.py").write_text(f"A = {i}\n")
        data, v = tar_of(src, ["a.py"])
        assert run_agent(wd, {"version": v, "base": versions[-1] if versions else None}, data)["ok"]
        versions.append(v)
        if i == 1:  # a live run (no exit code, no stop result) on the second release
            run = wd / "runs" / "live-job"
            run.mkdir(parents=True)
            (run / "job.json").write_text(json.dumps({"release": v}))
        if i == 2:  # a finished run on the third: it does not hold its release
            run = wd / "runs" / "done-job"
            run.mkdir(parents=True)
            (run / "job.json").write_text(json.dumps({"release": v}))
            (run / "exit_code").write_text("0\n")
        time.sleep(0.02)  # distinct mtimes: newest first
    with locked(str(wd / ".deploy.lock")):  # the collection, after each answer, holds the lock until it is done
        kept = set(os.listdir(wd / "releases"))
    assert kept == {versions[1], *versions[-3:]}, (kept, versions)
    assert os.readlink(wd / "code") == f"releases/{versions[-1]}"


def test_the_hash_cache_never_hides_a_change(client, tmp_path):
    """Same size, same mtime restored by hand: the ctime still moves, so the file is hashed again."""
    root = tmp_path / "tree"
    root.mkdir()
    f = root / "a.py"
    f.write_text("A = 1\n")
    old = time.time() - 60
    os.utime(f, (old, old))
    first = sync.build_manifest(root, ["a.py"])
    assert sync.build_manifest(root, ["a.py"]) == first  # served from the cache
    f.write_text("B = 2\n")
    os.utime(f, (old, old))
    again = sync.build_manifest(root, ["a.py"])
    assert again["a.py"].sha256 == sync.hash_file(f) != first["a.py"].sha256
    cache = sync.HashCache(root).path
    assert cache.stat().st_mode & 0o777 == 0o600


# --------------------------------------------------------------------------------------------- the agent's boot


def boot(home: Path, stdin: bytes, *args: str) -> subprocess.CompletedProcess:
    argv = boot_argv(sys.executable, "probe", json.dumps({"action": "tail", "path": "/proc/version", "lines": 1}))
    return subprocess.run([*argv, *args], input=stdin, capture_output=True, env={**os.environ, "HOME": str(home)})


def test_a_remote_sitecustomize_that_prints_cannot_corrupt_the_agents_answer(tmp_path):
    """A remote Python whose site hooks print (a sitecustomize, a .pth of some install): the agent is stdlib only and
    starts without `site`, so its stdout stays the one JSON answer the client parses."""
    home, hooks = tmp_path / "home", tmp_path / "hooks"
    home.mkdir()
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text("print('welcome to the cluster')\n")
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(hooks)}
    chatty = subprocess.run([sys.executable, "-c", "pass"], capture_output=True, text=True, env=env)
    assert chatty.stdout == "welcome to the cluster\n"  # the hook is live for an ordinary start
    argv = boot_argv(sys.executable, "probe", json.dumps({"action": "tail", "path": "/proc/version", "lines": 1}))
    res = subprocess.run(argv, input=AGENT, capture_output=True, env=env)
    assert res.returncode == 0 and json.loads(res.stdout)["exists"]


def test_the_agent_runs_only_when_its_hash_matches_and_nothing_on_the_remotes_disk_is_run(tmp_path):
    """The digest comes from this client's own package: a flipped bit runs nothing. Whatever sits in the remote's
    cache (an edited copy of the archive, an unpacked tree with a rewritten digest, a planted `__pycache__/*.pyc`)
    is never imported: the agent runs from the bytes that were checked, in memory."""
    home = tmp_path / "home"
    home.mkdir()
    mid = len(AGENT) // 2
    bad = boot(home, AGENT[:mid] + bytes([AGENT[mid] ^ 1]) + AGENT[mid + 1 :])  # one bit flipped on the way
    assert bad.returncode != 0 and b"not the agent of hash" in bad.stderr and not bad.stdout
    assert not (home / ".cache" / "dflashctl").exists()  # nothing kept, nothing run
    ok = boot(home, AGENT)
    assert ok.returncode == 0 and json.loads(ok.stdout)["exists"]
    cache = home / ".cache" / "dflashctl"
    assert cache.stat().st_mode & 0o777 == 0o700 and not list(cache.glob("agent-*"))
    pwned = tmp_path / "pwned"
    evil = f"import pathlib; pathlib.Path({str(pwned)!r}).touch()\n"
    (cache / f"agent-{AGENT_SHA}.pyz").write_text(evil)
    tree = cache / f"agent-{AGENT_SHA}" / "dflashctl" / "agent"
    (tree / "__pycache__").mkdir(parents=True)
    for name in ("__init__", "__main__", "probe", "common"):
        (tree / f"{name}.py").write_text(evil)
        import py_compile

        py_compile.compile(str(tree / f"{name}.py"), cfile=str(tree / "__pycache__" / f"{name}.cpython-311.pyc"))
    (tree.parent / ".digest").write_text("forged")
    again = boot(home, AGENT)
    assert again.returncode == 0 and json.loads(again.stdout)["exists"] and not pwned.exists()


def test_first_boots_at_once_all_run_and_an_unwritable_home_falls_back(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    argv = boot_argv(sys.executable, "probe", json.dumps({"action": "tail", "path": "/proc/version", "lines": 1}))
    procs = [
        subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "HOME": str(home)},
        )
        for _ in range(6)
    ]
    outs = [p.communicate(AGENT) for p in procs]
    assert all(p.returncode == 0 and json.loads(o)["exists"] for p, (o, _) in zip(procs, outs, strict=True))
    kept = sorted(p.name for p in (home / ".cache" / "dflashctl").iterdir())
    assert kept == []  # the agent runs from the bytes it was sent: no copy, no tree, no temp file left
    ro = tmp_path / "ro-home"
    ro.mkdir(mode=0o500)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "HOME": str(ro), "TMPDIR": str(tmp)}
    res = subprocess.run(argv, input=AGENT, capture_output=True, env=env)
    if os.geteuid() == 0:  # root writes anywhere: the fallback is then not reached
        assert res.returncode == 0
    else:
        assert res.returncode == 0 and list(tmp.glob("dflashctl-agent-*"))


@functools.cache
def oldest_python() -> str | None:
    """Python 3.8 (the oldest a remote may have), where this machine has it."""
    import shutil

    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for path in [shutil.which("python3.8"), *map(str, sorted(pyenv.glob("3.8*/bin/python3.8")))]:
        if (
            path
            and subprocess.run(
                [path, "-c", "import sys; assert sys.version_info[:2] == (3, 8)"], capture_output=True
            ).returncode
            == 0
        ):
            return path
    return None


@pytest.mark.skipif(oldest_python() is None, reason="no python3.8 on this machine to run the agent under")
def test_the_agent_runs_on_python_3_8_probe_with_gpu_readings_and_release(tmp_path):
    """The remote's own Python may be 3.8: the zipapp's probe (GPU readings parsed) and release run there."""
    py = oldest_python()
    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi"
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"time": 1, "step": 1, "loss": 2.0}\n')
    req = json.dumps({"run_dir": str(run), "gpus": True})
    gpu_csv = (fixtures / "h200-query-gpu-loaded.csv").read_text()
    argv = boot_argv(py, "probe", req)
    proc = subprocess.run(
        [*argv, gpu_csv, ""], input=AGENT, capture_output=True, env={**os.environ, "HOME": str(tmp_path)}
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    snap = json.loads(proc.stdout)
    assert snap["metrics"]["records"][0]["step"] == 1
    assert snap["gpu"]["gpus"] and snap["gpu"]["gpus"][0]["name"].startswith("NVIDIA H200")
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("print(1)\n")
    stream, version = tar_of(src, ["a.py"])
    wd = tmp_path / "wd"
    argv = boot_argv(py, "release", json.dumps({"workdir": str(wd), "version": version, "base": None}))
    res = subprocess.run(argv, input=AGENT + stream, capture_output=True, env={**os.environ, "HOME": str(tmp_path)})
    assert json.loads(res.stdout)["ok"], res.stderr.decode()[-2000:]
    assert (wd / "code" / "a.py").read_text() == "print(1)\n"


def test_a_file_gone_between_hashing_and_sending_fails_the_deploy_on_this_side(tmp_path):
    """The tar is written while it travels: a file removed after the manifest was built ends the stream early (the
    agent then refuses it, nothing switched) and the deploy names the file."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("a.py", "b.py"):
        (src / name).write_text(f"{name}\n")
    manifest = sync.build_manifest(src, ["a.py", "b.py"], cache=False)
    (src / "b.py").unlink()
    pipe = sync.TarPipe(src, ["a.py", "b.py"], manifest)
    data = pipe.read()
    with pytest.raises(sync.DflashError, match=r"b\.py.*changed while deploying"):
        pipe.close()
    ans = run_agent(tmp_path / "wd", {"version": sync.manifest_version(manifest), "base": None}, data)
    assert not ans["ok"] and not (tmp_path / "wd" / "code").exists()


def test_a_stream_whose_reader_stops_ends_its_writer(tmp_path):
    """The command exits without reading (a full disk, a refusal): closing the pipe ends the writer thread, with no
    error of its own."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(os.urandom(4 << 20))  # far more than a pipe holds
    manifest = sync.build_manifest(src, ["big.bin"], cache=False)
    pipe = sync.TarPipe(src, ["big.bin"], manifest)
    assert pipe.read(1024)
    pipe.close()
    assert not pipe._thread.is_alive() and 0 < pipe.sent < (4 << 20)
