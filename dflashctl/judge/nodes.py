"""Pure: the verdict of a job over several hosts from each node's own verdict. `now` is the caller's monotonic
clock (how long a node has been failing is measured by whoever looks, never from two machines' wall clocks).

The job's verdict is the worst node's, named: the first to fail when several did (the others' NCCL timeouts are its
consequence); an unreachable node is said and changes nothing else; a node that only lost a peer waits PEER_GRACE_S
for the peer's own word.
"""

from __future__ import annotations

from dataclasses import dataclass

from .facts import CASCADE, FAILURES, Verdict

CONSEQUENCES = CASCADE  # what the other nodes show when one of them failed first (the state table's `cascade`)
# A node whose failure is only a lost peer ("Connection closed by peer") names no cause: the peer's own verdict is
# awaited this long (its torchrun may take a second or two longer to end) before the lost peer is called the failure.
PEER_GRACE_S = 15.0


@dataclass
class Node:
    name: str  # its host's name
    verdict: Verdict
    lost_peer: bool = False  # its log says a peer was lost (a consequence, not a cause)
    exit_time: float | None = None  # when its command ended, its own clock (ordering only, within one node)


def combine(nodes: list[Node], bad_since: dict, now: float) -> Verdict:
    """The job's verdict. `bad_since`: node index -> when (caller's monotonic clock) it was first seen failing, kept
    by the caller between looks and updated here."""
    names = [n.name for n in nodes]
    verdicts = [n.verdict for n in nodes]
    for i, v in enumerate(verdicts):
        if v.state in FAILURES:
            bad_since.setdefault(i, now)
        else:
            bad_since.pop(i, None)
    others = [f"node {names[i]}: {v.state}: {v.reason}" for i, v in enumerate(verdicts)]
    reachable = [(i, v) for i, v in enumerate(verdicts) if v.state != "UNREACHABLE"]
    if not reachable:
        return Verdict("UNREACHABLE", f"no node answers ({', '.join(names)})", others, verdicts[0].advice)
    bad = [(i, v) for i, v in reachable if v.state in FAILURES]
    if bad:
        lost_peer = {i: v.state in CONSEQUENCES or nodes[i].lost_peer for i, v in bad}

        def first(item):  # a failure of its own over a lost peer, then the first seen, the first ended
            i, _ = item
            ended = nodes[i].exit_time
            return (lost_peer[i], bad_since[i], ended if ended is not None else float("inf"), i)

        if all(lost_peer.values()):
            waiting = [names[i] for i, v in reachable if v.state not in FAILURES and v.state != "FINISHED"]
            seen = min(bad_since[i] for i, _ in bad)
            if waiting and now - seen < PEER_GRACE_S:
                lost = ", ".join(names[i] for i, _ in bad)
                return Verdict(
                    "RUNNING",
                    f"node {lost} lost a peer; waiting for {', '.join(waiting)} to say why",
                    others,
                    None,
                    verdicts[0].step,
                )
        i, v = min(bad, key=first)
        return Verdict(v.state, f"node {names[i]}: {v.reason}", [*v.evidence, *others], v.advice, v.step)
    head = verdicts[0]
    if head.state == "UNREACHABLE":
        head = Verdict("RUNNING", "the head cannot be reached; the other nodes run", others)
    if head.state == "FINISHED":
        running = [names[i] for i, v in reachable if v.state != "FINISHED"]
        if running:
            return Verdict("RUNNING", f"the head finished; waiting for {', '.join(running)}", others, None, head.step)
    return Verdict(head.state, head.reason, [*head.evidence, *others[1:]], head.advice, head.step)
