"""Deploy against plain `rsync -a` over the same loopback sshd: a first deploy into an empty workdir, no change, one
file changed, and the ssh connections a deploy opens.

    .venv/bin/python bench/deploy_bench.py [--files 2000] [--mb 50] [--repeat 5] [--repeat-first 3]

Prints a table (median seconds of --repeat runs) and writes bench/results/deploy.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import loopback_sshd, timed  # noqa: E402
from dflashctl.config import HostConfig  # noqa: E402
from dflashctl.remote.ssh import SshRunner  # noqa: E402
from dflashctl.remote.sync import deploy  # noqa: E402


def make_tree(root: Path, files: int, total_mb: int) -> None:
    size = total_mb * (1 << 20) // files
    for i in range(files):
        p = root / f"d{i % 40:02d}" / f"f{i:05d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(os.urandom(size))
    subprocess.run(["git", "init", "-q", str(root)], check=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--mb", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--repeat-first", type=int, default=3, help="first deploys, each into an empty workdir")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="deploy-bench-"))
    server, home = loopback_sshd(work)
    src = work / "src"
    make_tree(src, args.files, args.mb)
    host = HostConfig(name="bench", ssh="root@127.0.0.1", port=server.port, identity_file=str(server.user_key))
    ssh_cmd = (
        f"ssh -p {server.port} -i {server.user_key} -o UserKnownHostsFile={home}/.ssh/known_hosts "
        "-o BatchMode=yes -o StrictHostKeyChecking=yes"
    )

    def ours(dst: str = "dst-ours"):
        before = SshRunner.connections_opened
        with SshRunner(host) as r:
            rep = deploy(r, src, str(work / dst))
        return rep, SshRunner.connections_opened - before

    def rsync(dst: str = "dst-rsync", *extra: str):
        subprocess.run(
            ["rsync", "-a", *extra, "--delete", "-e", ssh_cmd, f"{src}/", f"root@127.0.0.1:{work}/{dst}/"], check=True
        )

    fresh = iter(range(10**6))

    def first_ours():  # an empty workdir, no record of a last deploy, no hash cache: every file is read and hashed
        shutil.rmtree(state, ignore_errors=True)
        return ours(f"first-{next(fresh)}")

    def first_rsync():
        rsync(f"first-{next(fresh)}")

    def first_rsync_fsync():  # the reference with a durability like ours: every file on disk before it returns
        rsync(f"first-{next(fresh)}", "--fsync")

    try:
        from dflashctl.model.record import state_dir

        state = state_dir()
        first, conns = ours()
        rsync()
        firsts = {"ours": [], "rsync": [], "rsync_fsync": []}
        for _ in range(args.repeat_first):  # alternating, each after a sync: neither pays the other's dirty pages
            for name, fn in (("ours", first_ours), ("rsync", first_rsync), ("rsync_fsync", first_rsync_fsync)):
                os.sync()
                t0 = time.perf_counter()
                fn()
                firsts[name].append(time.perf_counter() - t0)
        first_s, rsync_first_s = (statistics.median(firsts[k]) for k in ("ours", "rsync"))
        nochange_ours = timed(lambda: ours(), args.repeat)
        nochange_rsync = timed(rsync, args.repeat)
        counter = iter(range(10**6))

        def touch_one():
            (src / "d00" / "f00000.bin").write_bytes(os.urandom(1024) + str(next(counter)).encode())

        def one_ours():
            touch_one()
            rep, _ = ours()
            assert rep.files_sent == 1

        def one_rsync():
            touch_one()
            rsync()

        pairs = []  # one changed file, ours and rsync alternating: each pair under the same load of the machine
        for _ in range(args.repeat):
            pairs.append((timed(one_ours, 1), timed(one_rsync, 1)))
        one_change_ours = statistics.median(p[0] for p in pairs)
        one_change_rsync = statistics.median(p[1] for p in pairs)
        one_ratio = statistics.median(p[0] / p[1] for p in pairs)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    py = platform.python_version()
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores; python {py}")
    print(
        f"tree: {args.files} files, {args.mb} MB; median of {args.repeat} ({args.repeat_first} for first deploys); "
        f"ssh connections per deploy: {conns}"
    )
    print("| case | dflashctl deploy (s) | rsync -a over ssh (s) |")
    print("| --- | --- | --- |")
    print(f"| first deploy (everything) | {first_s:.3f} | {rsync_first_s:.3f} |")
    print(f"| no change | {nochange_ours:.3f} | {nochange_rsync:.3f} |")
    print(f"| one file changed | {one_change_ours:.3f} | {one_change_rsync:.3f} |")
    print(f"one file changed, ours / rsync paired (median of {args.repeat} alternating pairs): {one_ratio:.3f}")
    print(
        f"| first deploy, rsync with --fsync (every file durable, as a release is) | | "
        f"{statistics.median(firsts['rsync_fsync']):.3f} |"
    )
    print(
        f"first deploy sent {first.files_sent} files, {first.bytes_sent / 1e6:.1f} MB; each first deploy (s): "
        + ", ".join(f"{k} {[round(x, 2) for x in v]}" for k, v in firsts.items())
    )
    out = {
        "machine": f"{platform.node()} {platform.machine()}",
        "cpu_count": os.cpu_count(),
        "python": py,
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
        "files": args.files,
        "mb": args.mb,
        "repeat": args.repeat,
        "repeat_first": args.repeat_first,
        "first_each_s": {k: [round(x, 3) for x in v] for k, v in firsts.items()},
        "ssh_connections_per_deploy": conns,
        "median_s": {
            "first": {
                "dflashctl": round(first_s, 3),
                "rsync": round(rsync_first_s, 3),
                "rsync_fsync": round(statistics.median(firsts["rsync_fsync"]), 3),
            },
            "no_change": {"dflashctl": round(nochange_ours, 3), "rsync": round(nochange_rsync, 3)},
            "one_file": {
                "dflashctl": round(one_change_ours, 3),
                "rsync": round(one_change_rsync, 3),
                "paired_ratio": round(one_ratio, 3),
                "pairs": [[round(a, 3), round(b, 3)] for a, b in pairs],
            },
        },
    }
    (Path(__file__).resolve().parent / "results" / "deploy.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
