"""`diagnose` on a big log against a plain Python loop with one regex over the same file (issue 40's yardstick).

Writes a log of --mb MB (step lines, an occasional warning, a recompile-limit warning in the middle and an OOM
through flex at the end), then times, each in a fresh process so that peak RSS is its own:
- the yardstick: `for line in open(f): rx.search(line)` with one literal regex;
- dflashctl's reader and classifier (`read_log` + `diagnose_lines`), the code `dflashctl diagnose` runs;
- with --gz, the same two on the log gzip'd (a rotated log): the yardstick reads it through `gzip.open`, dflashctl
  streams it forward once (`read_stream`);
- with --prefixed, the same two on the log as `kubectl logs --prefix --timestamps` prints it (every line behind a
  `[pod/NAME/CONTAINER] ` and an RFC 3339 stamp): what reading through a launcher's prefixes costs.
Prints a table and writes bench/results/diagnose.json.

    .venv/bin/python bench/diagnose_bench.py --mb 200 --repeat 3 --gz --prefixed --machine "2-core CI-like machine"
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BASELINE = """
import gzip, re, resource, sys, time
t = time.perf_counter(); rx = re.compile(r"Traceback \\(most recent call last\\)"); n = 0
with (gzip.open(sys.argv[1], "rt", errors="replace") if sys.argv[1].endswith(".gz") else
      open(sys.argv[1], errors="replace")) as f:
    for line in f:
        if rx.search(line):
            n += 1
print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, n)
"""
OURS = """
import resource, sys, time
sys.path.insert(0, sys.argv[2])
from dflashctl.judge.diagnosis import diagnose_lines
from dflashctl.logfile import read_log
t = time.perf_counter(); v = diagnose_lines(read_log(sys.argv[1]))
print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, v.state)
"""


KUBECTL = "[pod/drafter-train-0/trainer] 2026-12-01T05:{:02d}:{:02d}.{:09d}Z "


def write_log(path: Path, mb: int, prefixed: bool = False) -> None:
    step = "step {}/2000000 epoch 0 loss {:.4f} acc 0.512 lr 5.97e-04 grad_norm 0.402 62,140 tok/s peak 58.1 GiB\n"
    warn = "W1201 05:10:44.118000 77120 torch/_inductor/utils.py:1250] [0/0] Not enough SMs to use max_autotune\n"
    end = (
        'Traceback (most recent call last):\n  File "/opt/venv/lib/torch/_tensor.py", line 631, in backward\n'
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 46.00 GiB. GPU 0 has a total capacity "
        "of 139.80 GiB of which 1.05 GiB is free.\n"
    )
    with path.open("w") as f:
        i = 0

        def put(text: str) -> None:
            for line in text.splitlines(keepends=True):
                f.write(KUBECTL.format(i // 60000 % 60, i // 1000 % 60, i * 7919 % 10**9) + line if prefixed else line)

        put("[dflashctl] 2026-12-01T00:00:00Z start \n")
        while f.tell() < mb << 20:
            i += 1
            put(warn if i % 5000 == 0 else step.format(i, 2.5 - (i % 1000) * 1e-4))
            if i == 1_000_000:
                put(
                    "W1130 18:02:10.258000 4976 torch/_dynamo/convert_frame.py:1358] [0/2] torch._dynamo hit "
                    "config.recompile_limit (2)\n"
                )
        put(end)


def run(code: str, path: Path) -> tuple[float, float, str]:
    out = subprocess.run([sys.executable, "-c", code, str(path), str(ROOT)], capture_output=True, text=True, check=True)
    secs, rss, what = out.stdout.split()
    return float(secs), float(rss), what


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--gz", action="store_true", help="also time the log gzip'd")
    ap.add_argument("--prefixed", action="store_true", help="also time the log behind kubectl's prefix and stamps")
    ap.add_argument("--machine", default=None, help="how the results name the machine (default: platform's words)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train.log"
        write_log(path, args.mb)
        size = path.stat().st_size
        packed = Path(tmp) / "train.log.1.gz"
        packed_size = 0
        if args.gz:
            with path.open("rb") as src, gzip.open(packed, "wb", compresslevel=6) as dst:
                shutil.copyfileobj(src, dst, 8 << 20)
            packed_size = packed.stat().st_size
        kube = Path(tmp) / "kubectl.log"
        if args.prefixed:
            write_log(kube, args.mb, prefixed=True)
        base, ours, gz_base, gz_ours, px_base, px_ours = [], [], [], [], [], []
        for _ in range(args.repeat):  # alternate, so that both see the same page cache and machine phase
            base.append(run(BASELINE, path))
            ours.append(run(OURS, path))
            if args.gz:
                gz_base.append(run(BASELINE, packed))
                gz_ours.append(run(OURS, packed))
            if args.prefixed:
                px_base.append(run(BASELINE, kube))
                px_ours.append(run(OURS, kube))
    b_s, o_s = statistics.median(x[0] for x in base), statistics.median(x[0] for x in ours)
    rows = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": args.machine
        or f"{platform.machine()}, {platform.processor() or 'cpu'}, Python {platform.python_version()}",
        "log_mb": round(size / 2**20, 1),
        "baseline_s": round(b_s, 3),
        "baseline_peak_rss_mb": round(max(x[1] for x in base), 1),
        "diagnose_s": round(o_s, 3),
        "diagnose_peak_rss_mb": round(max(x[1] for x in ours), 1),
        "ratio": round(o_s / b_s, 2),
        "state": ours[0][2],
        "repeat": args.repeat,
    }
    print(f"{'':24}{'seconds':>10}{'peak RSS MB':>14}")
    print(f"{'one-regex loop':24}{b_s:>10.2f}{rows['baseline_peak_rss_mb']:>14.0f}")
    print(f"{'diagnose':24}{o_s:>10.2f}{rows['diagnose_peak_rss_mb']:>14.0f}   {rows['state']}, {rows['ratio']}x")
    if args.gz:
        gb, go = statistics.median(x[0] for x in gz_base), statistics.median(x[0] for x in gz_ours)
        rows.update(
            gz_mb=round(packed_size / 2**20, 1),
            gz_baseline_s=round(gb, 3),
            gz_baseline_peak_rss_mb=round(max(x[1] for x in gz_base), 1),
            gz_diagnose_s=round(go, 3),
            gz_diagnose_peak_rss_mb=round(max(x[1] for x in gz_ours), 1),
            gz_ratio=round(go / gb, 2),
            gz_state=gz_ours[0][2],
        )
        print(f"{'gzip one-regex loop':24}{gb:>10.2f}{rows['gz_baseline_peak_rss_mb']:>14.0f}")
        print(
            f"{'diagnose (gzip)':24}{go:>10.2f}{rows['gz_diagnose_peak_rss_mb']:>14.0f}   {rows['gz_state']}, "
            f"{rows['gz_ratio']}x"
        )
    if args.prefixed:
        pb, po = statistics.median(x[0] for x in px_base), statistics.median(x[0] for x in px_ours)
        rows.update(
            prefixed_baseline_s=round(pb, 3),
            prefixed_diagnose_s=round(po, 3),
            prefixed_diagnose_peak_rss_mb=round(max(x[1] for x in px_ours), 1),
            prefixed_ratio=round(po / pb, 2),
            prefixed_state=px_ours[0][2],
        )
        print(f"{'kubectl one-regex loop':24}{pb:>10.2f}{max(x[1] for x in px_base):>14.0f}")
        print(
            f"{'diagnose (kubectl)':24}{po:>10.2f}{rows['prefixed_diagnose_peak_rss_mb']:>14.0f}   "
            f"{rows['prefixed_state']}, {rows['prefixed_ratio']}x"
        )
    out = ROOT / "bench" / "results" / "diagnose.json"
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
