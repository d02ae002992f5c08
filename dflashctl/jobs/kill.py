"""`kill`: stop a job and record what was verified; a kill of a live job pages once (KILLED or KILL_FAILED)."""

from __future__ import annotations

import time
from collections.abc import Callable

from dflashctl.errors import ConfigError, DflashError, NoSuchJobError, NothingToDoError
from dflashctl.jobs import control, registry
from dflashctl.jobs.control import KillReport
from dflashctl.jobs.find import find_job
from dflashctl.jobs.poller import make_watcher
from dflashctl.jobs.registry import JobRecord
from dflashctl.jobs.status import status
from dflashctl.judge.facts import DONE_FOR_GOOD
from dflashctl.remote.connect import open_runner


def kill(
    spec: str | None,
    project: str,
    grace_s: float | None = None,
    accept_new: bool = False,
    confirm: Callable[[JobRecord], bool] | None = None,
) -> KillReport:
    """Stop a job and record what was verified: KILLED only when nothing of it is left, else KILL_FAILED. A bare
    `kill` with nothing alive kills nothing and says so; an ended job (CRASHED, ...) keeps its state when the kill
    found nothing of it. A bare `kill` retries a failed kill at once, but stops the newest live job only when
    `confirm` says yes (the user was asked, or passed --yes)."""
    if spec is None:
        try:
            job = find_job(None, project, live_only=True)
        except NoSuchJobError:
            raise NothingToDoError("no job of this project is alive: nothing to kill (see `dflashctl ls`)") from None
        if job.state != "KILL_FAILED" and not (confirm and confirm(job)):
            raise ConfigError(
                "kill",
                None,
                f"no job named: `dflashctl kill {job.id}` stops the newest alive job (or `dflashctl kill --yes`)",
            )
    else:
        job = find_job(spec, project)
    if job.state in DONE_FOR_GOOD:  # nothing to stop: say so, rewrite nothing
        raise NothingToDoError(f"{job.id} is already {job.state}: nothing to kill")
    report = control.stop_all(job, lambda h: open_runner(h, accept_new), grace_s)
    ended = not job.live and job.state != "KILL_FAILED" and not report.found and report.clean
    if report.ended_before is not None and report.clean:  # it had ended by itself: that verdict stands
        r = status(job.id, project, accept_new).report
        report.verdict = {"state": r.state, "reason": r.reason, "evidence": r.evidence, "advice": r.advice}
        ended = True
    if not ended:
        registry.update(job.id, state=report.result, killed_at=time.time())
        report.notices = _page_kill(job, report, accept_new)
    registry.append_event(
        job.id, {"decision": "kill", "result": report.result, "signalled": report.term, "remaining": report.remaining}
    )
    return report


def _page_kill(job: JobRecord, report: KillReport, accept_new: bool) -> dict:
    """A kill of a live job pages, once (its id is the job's end: a watch that saw it makes the same one): KILLED, or
    KILL_FAILED naming what survived; with what still waits in the outbox, sent within the budget."""
    if not job.watch.notify.webhook:
        return {}
    from dflashctl.judge.facts import ADVICE
    from dflashctl.judge.notice import Message, notice_id

    survived = [f"pid {p} survived SIGKILL" for p in report.remaining[:5]]
    survived += [
        f"pid {g.get('pid')} still holds GPU {g.get('index')}" for g in report.gpu_holders[:5] if isinstance(g, dict)
    ]
    failed = report.result != "KILLED"
    msg = Message(
        job.id,
        job.host_name,
        report.result,
        "stopped by `dflashctl kill`" + (": not everything ended" if failed else ", verified: nothing of it is left"),
        survived,
        ADVICE.get(report.result),
        job.restarts,
        time.time(),
        failed,
        0,
        f"dflashctl status {job.id}",
        notice_id(None, report.result),
        "killed" if not failed else "kill failed",
    )
    w = make_watcher(job, accept_new, by="kill")
    try:
        w.links[0].connect()
        return w.deliver([msg])
    except DflashError:
        return {}
    finally:
        for link in w.links:
            link.drop()
