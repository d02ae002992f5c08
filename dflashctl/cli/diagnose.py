"""`dflashctl diagnose LOG`: any training log classified by the rules `watch` uses, with what to do next."""

from __future__ import annotations

import sys

import typer

from dflashctl.cli.app import Flag, Named, app


@app.command()
def diagnose(
    log_file: str = typer.Argument(
        ...,
        metavar="LOG",
        click_type=Named(),
        help="A log file (train.log, a tmux capture, a SLURM output; gzip'd or not), or - for stdin.",
    ),
    as_json: bool = Flag("--json", help="Print {state, reason, evidence, advice, exit} as JSON."),
) -> None:
    """Classify any training log with the same rules `watch` uses, and say what to do next.

    Reads through launcher prefixes (torchrun's \\[rankN]:, srun --label, mpirun's \\[1,N]<stdout>:, Ray, SkyPilot,
    kubectl --prefix, torchx, pdsh, ts and other timestamps; others learned from the log itself) and any encoding (a
    BOM, UTF-16; runs of NUL bytes skipped and named), and judges the newest attempt. A log with no failure and no
    normal end is INCOMPLETE (exit 30), never an all-clear; a failure the run outlived before its normal end is a
    warning under FINISHED. Big logs are read from the tail in bounded memory; gzip'd logs and stdin are streamed in
    the same bound."""
    from dflashctl.errors import ConfigError
    from dflashctl.judge.diagnosis import diagnose_lines
    from dflashctl.judge.facts import EXIT_BY_STATE
    from dflashctl.logfile import LogFileError, read_log, read_stream
    from dflashctl.show.render import out, print_json

    try:  # stdin is streamed, gzip'd or not: the memory bound of a file
        lines = read_stream(sys.stdin.buffer) if log_file == "-" else read_log(log_file)
    except LogFileError as e:
        raise ConfigError(log_file, None, str(e)) from None
    v = diagnose_lines(lines)
    code = EXIT_BY_STATE.get(v.state, 0)
    if as_json:
        print_json({"state": v.state, "reason": v.reason, "evidence": v.evidence, "advice": v.advice, "exit": code})
    else:
        out.print(f"[bold]{v.state}[/]: {v.reason}")
        for line in v.evidence:
            out.print(f"  {line}", markup=False)
        if v.advice:
            out.print(f"next: {v.advice}", markup=False)
    raise typer.Exit(code)
