"""`dflashctl notices`: a job's notices and their deliveries, as a person reads them."""

from __future__ import annotations

import time

from dflashctl.show.render import err, neutralise, out


def _when(t) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if isinstance(t, (int, float)) and t else "-"


def render(log: dict) -> None:
    where = log.get("webhook") or "no webhook (nothing is sent)"
    err.print(f"{log['id']}: notices to {where}", markup=False)
    items = log.get("notices") or []
    if not items:
        err.print("no notice yet", markup=False)
        return
    for n in items:
        head = f"{n['state']}, {n['action']}" if n.get("action") else n["state"]
        out.print(
            f"{_when(n.get('created'))} {n['id']}: {head} [{n['status']}, {n['posts']} of {n['max_posts']} POSTs]",
            markup=False,
        )
        for e in n.get("log") or []:
            took = f" in {e['ms']} ms" if isinstance(e.get("ms"), int) else ""
            out.print(
                f"    {_when(e.get('time'))} by {e.get('by')}: {neutralise(str(e.get('result')))}{took}", markup=False
            )
