"""Where an export may be written, decided before torch is imported: `python -m trainer.export` refuses a bad
`--out` in a fraction of a second (the run dir, a folder of other files, a symlink), not after seconds of imports."""

from __future__ import annotations

import json
from pathlib import Path

from trainer.errors import ConfigError

DTYPE_NAMES = ("bfloat16", "float16", "float32")  # the export's dtypes (dflash_format.DTYPES maps them to torch's)
EXPORT_FILES = {"config.json", "model.safetensors"}


def check_out(out: Path, run_dir: Path | None = None, source: str = "--out") -> Path:
    """Where an export may go: a missing path, an empty folder, or an earlier export (config.json naming
    DFlashDraftModel, model.safetensors, nothing else). Never a file, a symlink, the run dir, one of its parents or
    a folder holding anything else: those are refused (ConfigError) before anything is written."""
    out = Path(out)
    if out.is_symlink():
        raise ConfigError(source, None, f"{out} is a symlink: give the folder itself")
    full = out.resolve()
    if run_dir is not None:
        run = Path(run_dir).resolve()
        if full == run or full in run.parents:
            raise ConfigError(source, None, f"{out} is the run dir or holds it: the export would replace the run")
    if full == Path(full.anchor) or full == Path.home().resolve():
        raise ConfigError(source, None, f"{out} is not a folder an export may replace")
    if not out.exists():
        return full
    if not out.is_dir():
        raise ConfigError(source, None, f"{out} exists and is not a folder")
    names = {p.name for p in out.iterdir()}
    if not names:
        return full
    if names <= EXPORT_FILES and "config.json" in names:
        try:
            arch = json.loads((out / "config.json").read_text()).get("architectures") or []
        except (OSError, ValueError, AttributeError):
            arch = []
        if "DFlashDraftModel" in arch:
            return full
    shown = ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
    raise ConfigError(
        source, None, f"{out} holds other files ({shown}): give an empty or new folder, or an earlier export"
    )
