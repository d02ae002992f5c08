"""The `dflashctl` command line, one module per command (or group): each parses, calls one library function that
returns a typed result, and renders it through `dflashctl/show/`. The Typer app is assembled here, in one place:
`app.py` holds it and what every command shares; importing a command's module registers it."""

from __future__ import annotations

import importlib

from dflashctl.cli.app import app, complete_hosts, complete_jobs, main, reflow_help, run

# the command modules, in the order --help lists them (the order a job's life takes)
COMMANDS = (
    "deploy",
    "doctor",
    "launch",
    "kill",
    "status",
    "report",
    "pull",
    "gc",
    "exec",
    "tunnel",
    "ls",
    "logs",
    "watch",
    "diagnose",
)
for _name in COMMANDS:
    importlib.import_module(f"dflashctl.cli.{_name}")
reflow_help()

__all__ = ["app", "complete_hosts", "complete_jobs", "main", "run"]
