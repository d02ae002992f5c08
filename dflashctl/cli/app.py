"""The Typer app and what every command shares: its options and arguments, shell completion, and the one handler
that turns typed errors into a one-line message and a documented exit code.

Exit codes: 0 success; 1 a remote command or check failed; 2 bad input (config, host, host key, unreachable host).
`watch`, `status`, `diagnose` and a `kill` of an ended job exit with the state's code, from the one state table
(judge/facts.py: `dflashctl watch --help` lists them); 130 Ctrl-C.
"""

from __future__ import annotations

import json
import sys

from dflashctl.show.fast_start import defer_unused_rich

defer_unused_rich()  # before typer: its help module imports rich's Markdown and tracebacks, which this app never draws

import typer  # noqa: E402
from typer._click.types import IntParamType, StringParamType  # noqa: E402 - typer <0.29 vendors click

from dflashctl import __version__  # noqa: E402
from dflashctl.errors import EXIT_FAILED, EXIT_USAGE, DflashError  # noqa: E402

# Everything else is imported inside the command that needs it: `--help` and `ls` must not pay for paramiko.

app = typer.Typer(
    name="dflashctl",
    help="Deploy, launch, watch and kill DFlash drafter training jobs on remote GPU boxes.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

_state = {"debug": False}


def Flag(*names: str, help: str, **kwargs) -> bool:  # noqa: N802 - reads like typer.Option at the call site
    """A boolean switch whose --help line shows no `<bool>` placeholder."""
    return typer.Option(False, *names, help=help, metavar=" ", show_default=False, **kwargs)


class Named(StringParamType):
    """An argument shown in --help by its name alone (HOST, JOB), not with `<str>` beside it."""

    def get_metavar(self, param, ctx=None) -> str:
        return ""


class NamedInt(IntParamType):
    def get_metavar(self, param, ctx=None) -> str:
        return ""


def between(option: str, value: int | None, lo: int, hi: int) -> None:
    """A number option's bounds, checked here (typer would print them as `[1<=x<=1024]` in --help): one line, exit 2."""
    from dflashctl.errors import ConfigError

    if value is not None and not lo <= value <= hi:
        raise ConfigError(option, None, f"{value} is not between {lo} and {hi}")


def complete_jobs(incomplete: str) -> list[str]:
    """Shell completion of job ids (from the local registry; nothing remote)."""
    try:
        from dflashctl.jobs import registry

        return [j.id for j in registry.all_jobs() if j.id.startswith(incomplete)]
    except Exception:
        return []


def complete_hosts(incomplete: str) -> list[str]:
    try:
        from dflashctl.config import known_hosts

        return [h for h in ["local", *known_hosts()] if h.startswith(incomplete)]
    except Exception:
        return []


def project() -> str:
    """The project's root, as every command that looks up a job names it."""
    from dflashctl.config import find_project_root

    return str(find_project_root())


HostArg = typer.Argument(
    ...,
    metavar="HOST",
    show_default=False,
    click_type=Named(),
    help="A host from dflashctl.yaml or hosts.yaml, `local`, user@host or ssh://host:port.",
    autocompletion=complete_hosts,
)
JobArg = typer.Argument(
    None,
    metavar="[JOB]",
    show_default=False,
    click_type=Named(),
    help="Job id, a prefix of it, or a job name; default: a job whose kill failed, else the newest "
    "alive, else the newest of this project.",
    autocompletion=complete_jobs,
)
JsonOpt = Flag("--json", help="Print one compact JSON object on stdout and nothing else.")
AcceptNewOpt = Flag("--accept-new-host-key", help="Record an unknown host key in known_hosts (like ssh's accept-new).")
ProjectOpt = Flag("--all-projects", help="List jobs launched from any project.")


def _version(value: bool) -> None:
    if value:
        print(f"dflashctl {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    debug: bool = Flag("--debug", help="Show tracebacks for errors."),
    version: bool = Flag("--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Deploy code into remote containers, launch the DFlash trainer in tmux, watch it, kill it cleanly."""
    _state["debug"] = debug


def reflow_help() -> None:
    """Docstrings are wrapped at 120 columns in the source; --help wraps them to the terminal. Each paragraph's
    lines are joined first, so no hard break leaves a ragged line (markdown mode would too, at the cost of
    importing a Markdown parser at every start)."""
    for info in app.registered_commands:
        doc = info.callback.__doc__ if info.callback else None
        if doc:
            paragraphs = [" ".join(ln.strip() for ln in p.strip().splitlines()) for p in doc.strip().split("\n\n")]
            info.callback.__doc__ = "\n\n".join(paragraphs)


# The verbs a SkyPilot user types (`sky queue`, `sky cancel`, `sky jobs`, `sky status -a`), answered with ours.
SKYPILOT_VERBS = {"queue": "ls", "jobs": "ls", "cancel": "kill"}


def skypilot_hint(args: list[str]) -> str | None:
    """A usage error that names our verb, where the command given is one of SkyPilot's."""
    words = [a for a in args if not a.startswith("-")]
    if not words:
        return None
    verb = words[0]
    if verb in SKYPILOT_VERBS:
        ours = SKYPILOT_VERBS[verb]
        return f"no command `{verb}` (SkyPilot's): did you mean `dflashctl {ours}`?"
    if verb == "status" and any(a in ("-a", "--all") for a in args):
        return "`status -a` is SkyPilot's: did you mean `dflashctl ls` (`ls --all-projects` for every project)?"
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point: one handler turns every typed error into a one-line message and its exit code. Under --json the
    same error is also printed on stdout as {"error", "exit"}, so a script never parses an empty answer."""
    args = sys.argv[1:] if argv is None else argv
    debug = _state["debug"] or "--debug" in args

    def fail(message: str, code: int) -> int:
        sys.stderr.write(f"dflashctl: error: {message}\n")
        if "--json" in args:
            sys.stdout.write(json.dumps({"error": message, "exit": code}) + "\n")
        return code

    hint = skypilot_hint(args)
    if hint:
        return fail(hint, EXIT_USAGE)
    try:
        rv = app(args=args, prog_name="dflashctl", standalone_mode=False)
        return rv if isinstance(rv, int) else 0
    except DflashError as e:
        if debug:
            raise
        if e.exit_code == 0:  # nothing to do: said, not an error
            sys.stderr.write(f"dflashctl: {e}\n")
            if "--json" in args:
                sys.stdout.write(json.dumps({"message": str(e), "exit": 0}) + "\n")
            return 0
        return fail(str(e), e.exit_code)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        kind = type(e).__name__
        if kind == "Exit":  # typer.Exit / click's, whichever click typer uses
            return int(getattr(e, "exit_code", 0) or 0)
        if kind == "NoArgsIsHelpError":  # a bare `dflashctl`: the help was asked for, in effect
            return 0
        if kind == "Abort":
            sys.stderr.write("aborted\n")
            return 130
        if hasattr(e, "format_message") and isinstance(getattr(e, "exit_code", None), int):
            # usage errors (unknown command or option, missing argument): click's own message, one line
            hint = " (see `dflashctl --help`)" if e.exit_code == EXIT_USAGE else ""
            return fail(e.format_message().replace("\n", " ") + hint, e.exit_code)
        if debug:
            raise
        return fail(f"internal error: {kind}: {e} (run with --debug for the traceback)", EXIT_FAILED)


def run() -> None:
    sys.exit(main())
