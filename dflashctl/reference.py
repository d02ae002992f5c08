"""`python -m dflashctl.reference > docs/commands.md`: the one-page command reference, generated from the CLI
itself (every command's help, arguments and options as `--help` has them), so it never drifts from the code
(`tests/test_cli.py` checks that the page is current)."""

from __future__ import annotations

import sys


def _params(cmd, ctx) -> list[str]:
    rows = []
    for p in cmd.params:
        if getattr(p, "hidden", False) or p.name == "help":
            continue
        names = " / ".join([*p.opts, *p.secondary_opts]) if p.param_type_name == "option" else (p.metavar or p.name)
        metavar = ""
        if p.param_type_name == "option" and not getattr(p, "is_flag", False) and p.metavar and p.metavar.strip():
            metavar = f" {p.metavar}"
        default = ""
        if p.param_type_name == "option" and p.default not in (None, False, (), []) and p.show_default is not False:
            default = f" (default: `{p.default}`)"
        text = " ".join((getattr(p, "help", "") or "").split())
        cell = f"{text}{default}".replace("|", "\\|")  # a `|` inside a cell would end it
        rows.append(f"| `{names}{metavar}` | {cell} |".replace("\n", " "))
    return rows


def render() -> str:
    import typer.main

    from dflashctl.cli import app

    root = typer.main.get_command(app)
    ctx = root.make_context("dflashctl", [], resilient_parsing=True)
    out = [
        "# Command reference",
        "",
        "Generated from the CLI itself by `python -m dflashctl.reference`; `dflashctl COMMAND --help` says the same.",
        "",
    ]
    out += [f"`dflashctl` — {' '.join((root.help or '').split())}", ""]
    for name in root.list_commands(ctx):
        cmd = root.get_command(ctx, name)
        if cmd is None or cmd.hidden:
            continue
        usage = " ".join(cmd.collect_usage_pieces(ctx))
        out += [f"## `dflashctl {name} {usage}`".rstrip(), ""]
        for para in (cmd.help or "").strip().split("\n\n"):
            out += [" ".join(para.split()).replace("\\[", "["), ""]
        rows = _params(cmd, ctx)
        if rows:
            out += ["| argument or option | meaning |", "| --- | --- |", *rows, ""]
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
