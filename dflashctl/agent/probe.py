"""Runs ON the remote, in its own Python, stdlib only (pynvml if importable): one call, one JSON answer about a job.

This module is the dispatch; each action lives in a module of its own: `snapshot.py` (a look, the progress
history), `starting.py` (launch, restart), `stopping.py` (reap), `files.py` (history, files, chunk, tail), `gpus.py`
(readings, gpu_holders), `procs.py` (the process table, tmux).

Shipped by `session.call_agent`: `python3 -c BOOT LEN REQUEST_JSON [GPU_CSV APPS_CSV]` with this file's source on
stdin (LEN bytes), followed by the action's payload (the run files of a launch). The CSVs are GPU readings taken on a
container's host by the same command. Actions:

- `snapshot` (default): the pane (alive or dead, exit status, last lines), the job's processes, new train.log bytes
  (bounded), new metrics.jsonl records (malformed ones counted, never fatal), the heartbeat as seen on this clock, the
  stop request and restart count, exit_code, GPU readings, free disk, our tmux sessions. With `record_gpu` (a
  `command:` job) the readings of the job's GPUs are appended to RUN/gpu.jsonl too.
- `launch`: under a host-wide lock, refuse GPUs held by our live jobs or unknown processes and a live job of the
  same name (unless forced), then create the run dir (0700, files 0600) and start the tmux session.
- `restart`: under the run dir's lock, refuse when a stop was requested, when another watcher already restarted this
  attempt, or when `max_restarts` is spent; else stop the old attempt, count the restart and start `--resume`.
- `reap` (kill): record a stop request under the run dir's lock, SIGTERM the job's processes, wait, SIGKILL what is
  left (and anything spawned meanwhile), verify, close the session, record the result in the run dir.
- `gpu_holders`: the GPU processes of this (host) machine with their pids in every pid namespace (`NSpid`).
- `history`: what `report` draws: metrics, GPU history and watch decisions of a run, thinned, in one answer.
- `files`, `chunk` (pull): files to bring back with their sha256; then raw bytes of one of them, a chunk at a time.
- `tail`: the last lines of a file, read from its end (bounded however long its lines are).
- `gc`: remove the run dirs of jobs that ended long enough ago, never a live one's (`collect.py`).
- `end_execs`: end the processes `exec` started for a job (`execs.py`, for `kill --all`).
- `end_member`: a member node of a job over several hosts ended for good: scrub, close its dead pane (`members.py`).
- `notices`, `notices_settled`, `notice_log`: the run dir's outbox as the laptop uses it: put its notices and claim
  what waits, say how each send went, list every notice's deliveries (`outbox.py`).

On a Slurm host (`"scheduler": "slurm"` in the request) the job's "pane" is its newest submission (agent/slurm.py):
`launch` writes the same run dir and runs `sbatch` instead of tmux, `restart` cancels the old submission, sees it end
and resubmits, `reap` runs `scancel` and waits for a final state, and `snapshot` reports Slurm's word on the job.

A process of the job is a descendant of the job's launcher (a child subreaper, so nothing escapes by double-forking
or `setsid`) or carries the job's tag in its environment; it is named by (pid, start time). A dead pane contributes no
process: its pid may belong to someone else by now. Nothing here imports the rest of dflashctl.
"""

from __future__ import annotations

import json
import os
import sys

from .procs import TMUX
from .snapshot import snapshot, wall_clock_hook


def main() -> int:
    req = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    if not isinstance(req, dict):
        req = {}
    if req.get("tmux_socket"):
        TMUX[2] = req["tmux_socket"]
    wall_clock_hook()  # tests only: a faked wall clock (DFLASHCTL_TEST_WALL_SHIFT_FILE), as the supervisor's
    if len(sys.argv) > 3:  # GPU readings taken on the container's host by the same command
        req["gpu_csv"], req["apps_csv"] = sys.argv[2], sys.argv[3]
    action = req.get("action", "snapshot")
    payload = sys.stdin.buffer.read() if action == "launch" else b""
    if action == "reap":
        from .stopping import reap

        answer = reap(req)
    elif action == "launch":
        from .starting import launch

        answer = launch(req, payload)
    elif action == "restart":
        from .starting import restart_action

        answer = restart_action(req)
    elif action == "gpu_holders":
        from .gpus import gpu_holders

        answer = gpu_holders(req)
    elif action == "stop_result":
        from .stopping import record_stop_result

        record_stop_result(req["run_dir"], req["report"])
        answer = {"ok": True}
    elif action == "files":
        from .files import pull_files

        answer = pull_files(req)
    elif action == "chunk":  # raw bytes, not JSON: the only action that answers so
        from .files import read_chunk

        sys.stdout.buffer.write(read_chunk(req))
        return 0
    elif action == "gc":
        from .collect import collect

        answer = collect(req)
    elif action == "hello":  # doctor: the agent runs here, as a deploy would run it
        answer = {
            "python": os.path.realpath(sys.executable),
            "version": sys.version.split()[0],
            "isolated": bool(sys.flags.isolated),
            "ok": True,
        }
    elif action == "end_execs":  # `kill --all`: what `exec` started for the job
        from .execs import end_execs

        answer = end_execs(req)
    elif action == "history":  # a report's metrics and events: the job's text, its secrets masked
        from .common import job_redactor
        from .files import history

        answer = job_redactor(req.get("run_dir")).deep(history(req))
    elif action == "scrub":
        from .common import scrub_ended

        answer = scrub_ended(req)
    elif action == "end_member":  # a node of a job over several hosts, ended for good (its head's supervisor)
        from .members import end_member

        answer = end_member(req)
    elif action == "notices_settled":  # how the laptop's sends of claimed notices went
        from .outbox import laptop_settle

        answer = laptop_settle(req)
    elif action == "notices":  # the laptop's notices put (a kill's), what waits claimed for it to send
        from .common import job_redactor
        from .outbox import laptop_claim

        run_dir = req.get("run_dir")
        ok = isinstance(run_dir, str) and os.path.isdir(run_dir)
        answer = job_redactor(run_dir).deep(laptop_claim(run_dir, req)) if ok else {"notices": [], "gone": True}
    elif action == "notice_log":  # `dflashctl notices`: every notice and its deliveries
        from .common import job_redactor
        from .outbox import listing

        run_dir = req.get("run_dir")
        ok = isinstance(run_dir, str) and os.path.isdir(run_dir)
        answer = {"notices": job_redactor(run_dir).deep(listing(run_dir)) if ok else [], "run_dir_exists": ok}
    elif action == "tail":
        from .files import tail_lines

        answer = tail_lines(req["path"], int(req.get("lines", 50)), int(req.get("limit", 1 << 20)))
    else:
        answer = snapshot(req)
    sys.stdout.write(json.dumps(answer, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
