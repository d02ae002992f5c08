"""The agent as one zipapp, byte for byte the same from the same sources: built by the client to ship, and by the
agent itself when it runs from plain files (a test) and must copy itself into a run dir."""

from __future__ import annotations

import io
import os
import zipfile

PACKAGE = "dflashctl_agent"  # its name inside the zipapp: never the installed `dflashctl`, whatever the remote has
ROOT_MAIN = f"import sys\nfrom {PACKAGE}.__main__ import main\nsys.exit(main())\n"
HERE = os.path.dirname(os.path.abspath(__file__))


JUDGE = "judge"  # the pure judge (stdlib only, relative imports), shipped inside the package for the supervisor


def _judge_dir(source_dir: str) -> str | None:
    """Where the judge's modules are: beside the agent's package in the source tree, or inside it (unpacked)."""
    for d in (os.path.join(source_dir, JUDGE), os.path.join(os.path.dirname(source_dir), JUDGE)):
        if os.path.isfile(os.path.join(d, "facts.py")):
            return d
    return None


def build(source_dir: str = HERE) -> bytes:
    """The package's modules under PACKAGE/, the judge's under PACKAGE/judge/, and a root __main__.py: fixed dates,
    sorted, deflated."""
    entries = [("__main__.py", ROOT_MAIN.encode())]
    for name in sorted(os.listdir(source_dir)):
        if name.endswith(".py"):
            with open(os.path.join(source_dir, name), "rb") as f:
                entries.append((f"{PACKAGE}/{name}", f.read()))
    judge = _judge_dir(source_dir)
    for name in sorted(os.listdir(judge)) if judge else []:
        if name.endswith(".py"):
            with open(os.path.join(judge, name), "rb") as f:
                entries.append((f"{PACKAGE}/{JUDGE}/{name}", f.read()))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in entries:
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            z.writestr(info, data)
    return buf.getvalue()


def own_archive() -> bytes:
    """The zipapp this agent runs from: the bytes BOOT checked and runs in memory, the file a zipimporter reads, or
    (run from plain files) the same zipapp built from them."""
    loader = globals().get("__loader__")
    data = getattr(loader, "agent_bytes", None)  # BOOT's in-memory importer: the very bytes it verified
    if data:
        return data
    archive = getattr(loader, "archive", None)  # a zipimporter knows its file
    if archive:
        with open(archive, "rb") as f:
            return f.read()
    return build()
