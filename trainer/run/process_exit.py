"""How a rank of a process group ends: flushed, with its exit code, and without the interpreter's teardown.

In the teardown (`Py_FinalizeEx`) a gloo worker thread can still be alive and drop the last reference to a finished
collective that holds a Python-owned tensor: at the end of a run, the closing barrier's work keeps the all-gathers
before it. Freeing that tensor takes the GIL of an interpreter that is going away, the thread is unwound through a
noexcept destructor, and the process aborts: SIGABRT, "terminate called without an active exception". A run that
finished then exits as a crash. `destroy_process_group` does not prevent it: a group lives on while anything refers to
it. On a loaded machine 2 two-rank runs in 115 ended so (docs/reliability.md says what the core showed).

Stdlib only: the entry point calls this after a config error too, before torch is imported.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def in_process_group() -> bool:
    """Whether torchrun started this process as one rank of several (WORLD_SIZE > 1)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def end_process(code: int) -> NoReturn:
    """Exit with `code`. One rank of several flushes what it printed and logged, then leaves at once (`os._exit`);
    a process alone exits as usual (`sys.exit`), atexit handlers and all."""
    if not in_process_group():
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can reach it
            pass
    if "logging" in sys.modules:
        sys.modules["logging"].shutdown()
    os._exit(code)
