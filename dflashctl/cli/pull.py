"""`dflashctl pull [JOB]` and `dflashctl export [JOB]`: a run's files brought home, resumable, hash-verified."""

from __future__ import annotations

from pathlib import Path

import typer

from dflashctl.cli.app import AcceptNewOpt, Flag, JobArg, JsonOpt, app, between, project


@app.command()
def pull(
    job: str | None = JobArg,
    export: bool = Flag("--export", help="The drafter in the public DFlash format (RUN/export)."),
    checkpoint: str | None = typer.Option(
        None, "--checkpoint", metavar="latest|STEP", help="'latest' or a step number."
    ),
    metrics: bool = Flag("--metrics", help="metrics.jsonl, gpu.jsonl, events.jsonl, train.log, job.json."),
    to: Path = typer.Option(Path("pulled"), "--to", metavar="DIR", help="Directory to pull into (as DIR/JOB-ID/...)."),
    chunk_mib: int = typer.Option(
        16, "--chunk-mib", metavar="MIB", help="Transfer size of one remote read, 1 to 1024."
    ),
    as_json: bool = JsonOpt,
    accept_new: bool = AcceptNewOpt,
) -> None:
    """Bring a run's export, checkpoint or metrics back here: resumable, hash-verified.

    Over the job's own transport (through its container too), never a partial file under its final name. Default:
    the export, else the newest checkpoint."""
    from dataclasses import asdict

    from dflashctl.config import find_project_root
    from dflashctl.errors import ConfigError
    from dflashctl.jobs.find import find_job
    from dflashctl.remote.pull import pull as pull_files
    from dflashctl.show import results
    from dflashctl.show.render import byte_progress, print_json

    between("--chunk-mib", chunk_mib, 1, 1024)
    if checkpoint is not None and checkpoint != "latest" and not checkpoint.isdigit():
        raise ConfigError("--checkpoint", None, f"{checkpoint!r} is neither 'latest' nor a step number")
    select = {k: v for k, v in (("export", export), ("checkpoint", checkpoint), ("metrics", metrics)) if v}
    root = find_project_root()
    record = find_job(job, project())
    with byte_progress(f"pull {record.id}", enabled=not as_json) as start_bar:
        report = pull_files(record, to, select, chunk_mib << 20, accept_new, start_bar, root)
    if as_json:
        print_json({"id": report.job, **asdict(report), "bytes_fetched": report.bytes_fetched})
        return
    results.pulled(report)


@app.command("export")
def export_drafter(
    job: str | None = JobArg,
    to: Path = typer.Option(Path("pulled"), "--to", metavar="DIR", help="Directory to pull into (as DIR/JOB-ID/...)."),
    as_json: bool = JsonOpt,
    accept_new: bool = AcceptNewOpt,
) -> None:
    """Bring the trained drafter home in the public DFlash format (what vLLM, SGLang and llama.cpp load).

    The same as `pull --export`: RUN/export, written at the end of training (or by `python -m trainer.export` on the
    host); resumable and sha256-verified."""
    pull(
        job=job,
        export=True,
        checkpoint=None,
        metrics=False,
        to=to,
        chunk_mib=16,
        as_json=as_json,
        accept_new=accept_new,
    )
