"""exec, shell and attach: run something in a job's exact code and environment, or open its pane.

They find the job as every command does (jobs/find.py) and talk to its host through one runner; `kill --all`
ends what `exec` started, found by the exec's own tag.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import subprocess
import time
from pathlib import Path

from dflashctl.config import HostConfig, resolve_host
from dflashctl.errors import ConfigError, RefusedError
from dflashctl.jobs.find import check_number, find_job
from dflashctl.jobs.registry import REMOVED, JobRecord
from dflashctl.remote import session
from dflashctl.remote.connect import open_runner
from dflashctl.remote.sync import read_remote_state


def _where(spec: str, root: Path, is_host: bool) -> tuple[HostConfig, str | None, str | None, str]:
    """(host, remote working dir, env file, tag) for `exec`/`shell`: a job's release, its job.env and the job's tag,
    or a host's deployed code (None: found on the remote) with neither. A job whose run dir `gc` removed is refused
    here, with who removed it and when: nothing of it is left to run in."""
    if is_host:
        return resolve_host(spec, root), None, None, ""
    job = find_job(spec, str(root))
    if job.state == REMOVED:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(job.removed_at)) if job.removed_at else "a time unknown"
        raise RefusedError(
            f"{job.id}: its run dir (environment, logs) was removed by {job.removed_by or 'someone'} "
            f"at {when} (`dflashctl gc`): launch the job again, or drop the record with "
            f"`dflashctl ls --forget {job.id}`"
        )
    workdir = os.path.dirname(os.path.dirname(job.run_dir))
    return job.host, f"{workdir}/releases/{job.release}", f"{job.run_dir}/{session.ENV_FILE}", job.tag


KILL_AFTER_S = 5  # SIGKILL this long after the SIGTERM, for a command (or a descendant) that ignores it

# The job's environment for exec and shell: once the job has ended for good its secrets were scrubbed from the run dir
# (`NAME=***` in job.env, their fingerprints in .redact.json beside it; so is any variable that held a secret's
# value): those are unset, never passed on as the literal `***` (an unquoted `$TOKEN` globs into a file listing),
# and a note on stderr names them.
LOAD_JOB_ENV = (
    session.LOAD_ENV
    + r"""
load_job_env() {
  local kv scrubbed=""
  [ -f "${1%/*}/.redact.json" ] || { load_env "$1"; return; }
  while IFS= read -r -d "" kv; do
    if [ "${kv#*=}" != "***" ]; then export "$kv" || return 1; continue; fi
    unset -v "${kv%%=*}" 2>/dev/null; scrubbed="$scrubbed ${kv%%=*}"
  done < "$1"
  [ -z "$scrubbed" ] || echo "dflashctl: the job has ended and its secrets were scrubbed from its run dir;" \
    "unset here:$scrubbed" >&2
}
"""
)

# $1 the directory, $2 the job's env file (or ""), $3 the timeout (or ""), $4 the exec's own tag, then the command.
# The job's DFLASHCTL_JOB_ID is replaced by the exec's own tag (the job's kept in DFLASHCTL_EXEC_OF), so that a stop
# or restart of the job, which finds its processes by that tag, leaves a debugging command alone (`kill --all` asks
# for them too). The command runs as a child, not exec'd: a signal's death reaches us as 128+N, not ssh's 255.
# Only the command is given the tag (an assignment before it), never this script, so the script's own helpers (grep,
# sleep) are never taken for the command's.
# A timeout: `timeout` signals the command's process group when it fires, but a descendant that called setsid is in
# a group of its own and would hold the channel open (the call returned after 47 s for `--timeout 3`). So once the
# command has returned, whatever still carries its tag gets the rest of the time (a `sleep` is the clock:
# monotonic), then SIGTERM, KILL_AFTER_S more, then SIGKILL; the status is then 124.
EXEC_SCRIPT = (
    LOAD_JOB_ENV
    + r"""
left() {  # the pids that still carry this exec's tag: the command's descendants, in sessions of their own too
  local f; pids=()
  for f in $(grep -lsFxz -e "DFLASHCTL_JOB_ID=$tag" /proc/[0-9]*/environ); do
    f="${f#/proc/}"; pids+=("${f%/environ}")
  done
  [ ${#pids[@]} -gt 0 ]
}
wait_while_left() { while left && kill -0 "$1" 2>/dev/null; do sleep 0.1; done; }
if [ -n "$2" ] && [ ! -d "${2%/*}" ]; then
  echo "dflashctl exec: the job's run dir ${2%/*} is gone (\`dflashctl gc\` elsewhere, or by hand)" >&2; exit 126
fi
if ! cd -P -- "$1" 2>/dev/null; then  # -P: the release itself, should a deploy switch `code` meanwhile
  echo "dflashctl exec: $1 is not there (a release collected since, or nothing deployed yet)" >&2; exit 126
fi
if [ -n "$2" ] && ! load_job_env "$2"; then
  echo "dflashctl exec: the job's environment $2 cannot be read (a job launched before job.env existed?)" >&2; exit 126
fi
if [ -n "$2" ]; then export DFLASHCTL_EXEC_OF="${DFLASHCTL_JOB_ID-}"; else unset DFLASHCTL_EXEC_OF; fi
t="$3"; tag="$4"; shift 4
unset -f load_env load_job_env
if [ -z "$t" ]; then unset -f left wait_while_left; DFLASHCTL_JOB_ID="$tag" "$@"; exit $?; fi
sleep "$t" </dev/null >/dev/null 2>&1 & clock=$!
DFLASHCTL_JOB_ID="$tag" timeout -k KILL_AFTER_S "$t" "$@"; rc=$?
wait_while_left "$clock"
if left; then
  echo "dflashctl exec: --timeout $t: ending what the command left running in sessions of their own: ${pids[*]}" >&2
  kill -TERM "${pids[@]}" 2>/dev/null; kill -CONT "${pids[@]}" 2>/dev/null
  sleep KILL_AFTER_S </dev/null >/dev/null 2>&1 & grace=$!
  wait_while_left "$grace"
  for _ in 1 2 3; do left && kill -KILL "${pids[@]}" 2>/dev/null && sleep 0.1; done
  kill "$grace" 2>/dev/null
  rc=124
fi
kill "$clock" 2>/dev/null
exit $rc
""".replace("KILL_AFTER_S", str(KILL_AFTER_S))
)


def end_execs(spec: str | None, project: str, grace_s: float = 5.0, accept_new: bool = False) -> dict:
    """`kill --all`: end what `exec` started for the job (found by DFLASHCTL_EXEC_OF, its own tag), which a kill or
    restart of the job alone leaves running. {id, term, kill, left}."""
    job = find_job(spec, project)
    with open_runner(job.host, accept_new) as runner:
        ans = session.call_agent(
            runner, {"action": "end_execs", "job_id": job.tag, "grace_s": grace_s, "gpus": False}, timeout=grace_s + 60
        )
    if ans.get("refused"):
        raise ConfigError("kill", "--all", ans["refused"])
    return {"id": job.id, **ans}


def exec_argv(command: list[str]) -> list[str]:
    """One string is a shell command line (`exec JOB -- 'a; b'`, as `ssh host 'a; b'` and `sky exec` run it);
    several words are an argument list, run as given."""
    return ["bash", "-c", command[0]] if len(command) == 1 else list(command)


def exec_command(
    spec: str,
    command: list[str],
    root: Path,
    is_host: bool = False,
    accept_new: bool = False,
    timeout: float | None = None,
    stdin=None,
) -> dict:
    """Run one command on a job's host (in its container) in the job's release with the job's very environment
    (job.env), or on a host in its deployed code: {exit, stdout, stderr}. `timeout` (> 0 s) bounds the whole call:
    the command's process group and its descendants in sessions of their own (by the exec's tag) are ended on the
    remote; `stdin` (a stream) is passed through, and its reader is done before this returns."""
    from dflashctl.remote.transport import UserStdin

    if not command:
        raise ConfigError("exec", "COMMAND", "nothing to run: give a command after --")
    check_number("--timeout", timeout, positive=True)
    host, cwd, env, tag = _where(spec, root, is_host)
    own_tag = f"{tag or 'host'}.exec.{secrets.token_hex(4)}"  # what finds the command's descendants at a timeout
    with open_runner(host, accept_new) as runner:
        if is_host:
            abs_wd, _, _ = read_remote_state(runner, host.workdir)
            cwd = f"{abs_wd}/code"
        argv = [
            "bash",
            "--noprofile",
            "--norc",
            "-c",
            EXEC_SCRIPT,
            "dflashctl-exec",
            cwd or "",
            env or "",
            repr(float(timeout)) if timeout else "",
            own_tag,
            *exec_argv(command),
        ]
        local_limit = timeout + 2 * KILL_AFTER_S + 30 if timeout else None  # the remote's own deadline comes first
        with UserStdin(stdin) if stdin is not None else contextlib.nullcontext() as passed:
            res = runner.run(argv, timeout=local_limit, stdin=passed)
    return {
        "host": host.name,
        "cwd": cwd,
        "exit": res.returncode,
        "tag": own_tag,
        "stdout": res.stdout.decode(errors="replace"),
        "stderr": res.stderr.decode(errors="replace"),
    }


# $1 the directory (a leading ~/ is the remote's $HOME), $2 the job's env file (or ""). The interactive shell's rc
# file reads the user's ~/.bashrc, then the job's environment (as exec does), then enters the directory: the values
# travel as arguments and are quoted by printf %q on the remote, never pasted into a script.
SHELL_SCRIPT = (
    LOAD_JOB_ENV
    + """
d="$1"; case "$d" in "~") d="$HOME";; "~/"*) d="$HOME/${d#"~/"}";; esac
if [ -n "$2" ] && ! [ -r "$2" ]; then echo "dflashctl shell: the job's environment $2 cannot be read" >&2; exit 126; fi
exec bash --rcfile <(
  echo '[ -f ~/.bashrc ] && . ~/.bashrc'
  declare -f load_env load_job_env
  [ -n "$2" ] && printf 'load_job_env %q\\n' "$2"
  printf 'cd -- %q || echo "dflashctl shell: cannot enter that directory" >&2\\n' "$d"
) -i
"""
)


def shell_argv(spec: str, root: Path, is_host: bool = False) -> list[str]:
    """An interactive shell on the job's host (inside its container), in the job's release with its environment
    (job.env, read after the user's ~/.bashrc), or on a host in its deployed code: the system's ssh, as `attach`
    uses. Every path is an argument of `bash -c`, quoted once for the ssh layer."""
    from dflashctl.remote.transport import container_prefix

    host, cwd, env, _ = _where(spec, root, is_host)
    cwd = cwd or f"{host.workdir.rstrip('/')}/code"
    inner = ["bash", "--noprofile", "--norc", "-c", SHELL_SCRIPT, "dflashctl-shell", cwd, env or ""]
    prefix = container_prefix(host)
    if prefix[:2] == ["docker", "exec"]:
        prefix = ["docker", "exec", "-it", *prefix[3:]]
    if host.is_local:
        return [*prefix, *inner]
    from dflashctl.remote.ssh import client_options

    ssh = [
        "ssh",
        "-t",
        *client_options(host),
        *(["-p", str(host.port)] if host.port else []),
        *(["-l", host.user] if host.user else []),
        *(["-i", host.identity_file] if host.identity_file else []),
    ]
    return [*ssh, host.ssh or "", shlex.join([*prefix, *inner])]


VIEW_PREFIXES = ("C-b", "C-a", "C-]")  # the view's prefix key: tmux's own, unless the user's tmux takes it


def view_prefix() -> str:
    """The prefix key of the job's view: tmux's default C-b, but when this terminal is inside tmux ($TMUX) the first
    of C-b, C-a, C-] that the user's own tmux does not take (its prefix and prefix2): there `Ctrl-b d` is read by
    their tmux and detaches their own session, never the view inside it."""
    if not os.environ.get("TMUX"):
        return VIEW_PREFIXES[0]
    try:
        said = subprocess.run(
            ["tmux", "display-message", "-p", "#{prefix} #{prefix2}"],
            capture_output=True,
            text=True,
            timeout=10,
            stdin=subprocess.DEVNULL,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        said = []
    taken = set(said) or {"C-b"}  # not asked: tmux's default
    return next((k for k in VIEW_PREFIXES if k not in taken), VIEW_PREFIXES[-1])


def view_hint(prefix: str) -> str | None:
    """What to tell a user whose view has another prefix than tmux's default (they are inside tmux)."""
    if prefix == VIEW_PREFIXES[0]:
        return None
    key = prefix.replace("C-", "Ctrl-")
    return f"inside tmux: this view's prefix is {key}: detach it with {key} d (Ctrl-b d is your own tmux's)"


def _view_options(session: str, prefix: str) -> list[str]:
    """tmux commands, each ended by `;`, that give the session the view's prefix and, for another one than tmux's
    own, say on its status line how to detach (a view inside tmux shows nothing printed before it opened)."""
    target = ["-t", f"={session}:"]  # a pane target: `=NAME:` is the session NAME exactly
    if prefix == VIEW_PREFIXES[0]:
        return ["set-option", *target, "-u", "prefix", ";", "set-option", *target, "-u", "status-right", ";"]
    key = prefix.replace("C-", "Ctrl-")
    return [
        "set-option",
        *target,
        "prefix",
        prefix,
        ";",
        "set-option",
        *target,
        "status-right",
        f" detach: {key} d ",
        ";",
    ]


def attach_argv(job: JobRecord, write: bool = False, prefix: str = VIEW_PREFIXES[0]) -> list[str]:
    """The command that opens the job's pane: `ssh -t HOST [pct exec CT --] tmux -L SOCK set-option ... ; attach -r
    -t =SESSION`: the session's prefix is set at each attach (view_prefix: another one inside tmux), on our own tmux
    server alone. The system's ssh is used, so the user's own config, agent and known_hosts
    apply. A Slurm job has no pane: its train.log is followed (`tail -F`), or with `write` its step is attached with
    `sattach`."""
    from dflashctl.remote.transport import container_prefix

    # the view is nested on purpose (its own prefix inside the user's tmux): tmux's own nesting check compares this
    # terminal with every pane our server ever had, and a dead pane's old tty name, reused by the user's new pane,
    # made it refuse ("sessions should be nested with care"); the view's client does not inherit $TMUX
    tmux = [
        "env",
        "-u",
        "TMUX",
        "tmux",
        "-L",
        job.tmux_socket,
        *_view_options(job.session, prefix),
        "attach",
        "-t",
        f"={job.session}",
        *([] if write else ["-r"]),
    ]
    if job.scheduler == "slurm":  # no pane: follow the log read-only, or (--write) sattach to the newest step 0
        log = shlex.quote(f"{job.run_dir}/train.log")
        tmux = [
            "bash",
            "-c",
            f'exec sattach "$(cat {shlex.quote(job.run_dir)}/slurm_job).0"' if write else f"exec tail -n 100 -F {log}",
        ]
    host = job.host
    prefix = container_prefix(host)
    if prefix[:2] == ["docker", "exec"]:
        prefix = ["docker", "exec", "-it", *prefix[3:]]
    if host.is_local:
        return [*prefix, *tmux]
    from dflashctl.remote.ssh import client_options  # the config and known_hosts every other command reads

    ssh = [
        "ssh",
        "-t",
        *client_options(host),
        *(["-p", str(host.port)] if host.port else []),
        *(["-l", host.user] if host.user else []),
        *(["-i", host.identity_file] if host.identity_file else []),
    ]
    return [*ssh, host.ssh or "", shlex.join([*prefix, *tmux])]
