"""`python3 agent.pyz ACTION ...`: the one entry point of the remote agent."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    action = argv[0] if argv else ""
    if action == "probe":
        from . import probe as agent
    elif action == "release":
        from . import release as agent
    elif action == "launch":
        from . import launcher as agent
    elif action == "supervise":
        from . import supervise as agent
    else:
        sys.stderr.write(f"dflashctl agent: unknown action {action!r} (probe, release, launch or supervise)\n")
        return 2
    sys.argv = [sys.argv[0], *argv[1:]]  # each action reads its arguments as it did when shipped alone
    return agent.main()


if __name__ == "__main__":
    sys.exit(main())
