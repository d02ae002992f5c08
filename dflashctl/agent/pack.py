"""The agent as one zipapp, byte for byte the same from the same sources: built by the client to ship, and by the
agent itself when it runs from plain files (a test) and must copy itself into a run dir. Its layout is the source
tree's: `dflashctl/agent/` and `dflashctl/judge/`."""

from __future__ import annotations

import io
import os
import zipfile

PACKAGE = "dflashctl.agent"  # the agent's package, inside the zipapp as in the source tree
ROOT_MAIN = f"import sys\nfrom {PACKAGE}.__main__ import main\nsys.exit(main())\n"
HERE = os.path.dirname(os.path.abspath(__file__))
# what the zipapp holds, in the source tree's layout: the package's own __init__ (its version), the agent, and the
# pure judge the supervisor decides with. Every agent module imports the judge as in the tree (`from ..judge import
# facts`). The interpreter runs isolated and without site (`-I -S`): a `dflashctl` installed on the remote is never
# on its path, and the boot line's importer, first on the meta path, serves these bytes only.
PARTS = ("agent", "judge")


def build(source_dir: str = HERE) -> bytes:
    """`dflashctl/__init__.py`, `dflashctl/agent/*.py`, `dflashctl/judge/*.py` and a root __main__.py: fixed
    dates, sorted, deflated (the same bytes from the same sources)."""
    root = os.path.dirname(source_dir)
    entries = [("__main__.py", ROOT_MAIN.encode())]
    with open(os.path.join(root, "__init__.py"), "rb") as f:
        entries.append(("dflashctl/__init__.py", f.read()))
    for part in PARTS:
        folder = os.path.join(root, part)
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py"):
                with open(os.path.join(folder, name), "rb") as f:
                    entries.append((f"dflashctl/{part}/{name}", f.read()))
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
