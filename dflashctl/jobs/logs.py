"""`logs`: the end of a job's train.log, read from its end; followed to the job's end with `-f`."""

from __future__ import annotations

import time
from collections.abc import Callable

from dflashctl.errors import RemoteCommandError
from dflashctl.jobs.find import find_job
from dflashctl.jobs.secrets import redactor
from dflashctl.remote import session
from dflashctl.remote.connect import open_runner

LOG_TAIL_BYTES = 4 << 20  # `logs -n N` reads at most this much from the end, however long the lines are


def logs(
    spec: str | None,
    project: str,
    lines: int = 50,
    follow: bool = False,
    emit: Callable[[str], None] = print,
    poll_s: float = 2.0,
    accept_new: bool = False,
    node: str | None = None,
) -> dict:
    """Print the last `lines` lines of train.log (a multi-node job: the head's, or `node`'s); with follow, keep
    printing until the job has ended."""
    job = find_job(spec, project)
    if node is not None:
        job = job.member(node)
    clean = redactor(job)  # the job printed its secrets maybe: never shown
    emit = (lambda text, show=emit: show(clean.chunk(text))) if clean else emit
    with open_runner(job.host, accept_new) as runner:
        got = session.call_agent(
            runner,
            {
                "action": "tail",
                "path": f"{job.run_dir}/train.log",
                "lines": lines,
                "limit": LOG_TAIL_BYTES,
                "gpus": False,
            },
        )
        if not got.get("exists"):
            raise RemoteCommandError(f"{job.id}: cannot read train.log: {got.get('error')}")
        if got["text"]:
            emit(got["text"])
        offset = got["size"]
        snap: dict = {}
        while follow:
            req = {**session.probe_request(job, log_offset=offset, capture_lines=0), "gpus": False}
            snap = session.call_agent(runner, req)
            new = snap.get("log", {})
            if new.get("text"):
                emit(new["text"].rstrip("\n"))
            offset = new.get("offset", offset)
            pane = snap["session"]
            if snap.get("exit_code") is not None or not pane.get("exists") or pane.get("pane_dead"):
                break
            time.sleep(poll_s)
    return {"id": job.id, "exit_code": snap.get("exit_code") if follow else None}
