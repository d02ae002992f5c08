"""`dflashctl report [JOB]...`: a run's curves, in the terminal or as a PNG or HTML file."""

from __future__ import annotations

from pathlib import Path

import typer

from dflashctl.cli.app import AcceptNewOpt, JsonOpt, Named, app, complete_jobs


@app.command()
def report(
    jobs: list[str] | None = typer.Argument(
        None,
        metavar="[JOB]...",
        show_default=False,
        click_type=Named(),
        help="Job ids or names (default: as for any command); several overlay",
        autocompletion=complete_jobs,
    ),
    out_file: Path | None = typer.Option(
        None, "--out", "-o", metavar="FILE", help="Write FILE.png or FILE.html (needs matplotlib)."
    ),
    as_json: bool = JsonOpt,
    accept_new: bool = AcceptNewOpt,
) -> None:
    """Draw a run's curves, running or finished (in the terminal, or --out FILE.png|.html).

    Loss and accuracy, tokens/s, tau with its prompt set, lr and grad norm by step; each GPU's util, memory and power
    by time; the preflight, restarts and verdicts marked. Several jobs overlay."""
    from dflashctl.config import find_project_root
    from dflashctl.errors import ConfigError
    from dflashctl.jobs.history import histories
    from dflashctl.show import report as reporting
    from dflashctl.show import results
    from dflashctl.show.render import err, out, print_json, show_lines

    suffix = out_file.suffix.lower() if out_file else None
    if suffix not in (None, ".png", ".html"):
        raise ConfigError(str(out_file), "--out", "must end in .png or .html")
    if out_file is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError(
                str(out_file), "--out", "drawing a file needs matplotlib: pip install 'dflashctl[report]'"
            ) from None
    got = histories(list(jobs or []), str(find_project_root()), accept_new)
    runs = [reporting.series(job.id, hist) for job, hist in got]
    summaries = [reporting.summary(r, hist, len(job.gpus)) for r, (job, hist) in zip(runs, got, strict=True)]
    if out_file is not None:
        from dflashctl import outputs
        from dflashctl.show import plots

        reporting.check_out_file(out_file)
        try:
            (plots.write_png if suffix == ".png" else lambda r, p: plots.write_html(r, summaries, p))(runs, out_file)
        except OSError as e:
            raise ConfigError(str(out_file), "--out", f"cannot be written: {e.strerror or e}") from None
        mine = outputs.remember(find_project_root(), out_file)
        err.print(f"wrote {out_file}" + (" (dflashctl's own output: never deployed)" if mine else ""))
    if as_json:
        print_json({"jobs": summaries, "out": str(out_file) if out_file else None})
        return
    if out_file is None:
        from rich.text import Text

        from dflashctl.show import plots

        out.print(Text.from_ansi(plots.terminal(runs, min(80, out.width))))
    show_lines([results.run_summary(s) for s in summaries])
