"""The remote agent as one zipapp, built here byte for byte the same every time, and the boot line that runs it.

Each remote command sends the zipapp on stdin ahead of its own payload: `python3 -c BOOT LEN SHA ACTION ...`. BOOT
reads LEN bytes, checks their SHA-256 against the one this client computed from its own package, and imports the
agent's modules from those very bytes, in memory: nothing on the remote's disk is run (no cached copy, no unpacked
tree, no `__pycache__` that someone could edit or plant), so the remote runs exactly what this client sent. Each
module is compiled as it is imported (what a probe imports: its own modules and the judge, a few hundredths of a
second). A job's tmux pane runs the launcher from the run dir's copy (`agent.pyz`, written at launch from the same
bytes and checked again before every restart, by the supervisor too).
"""

from __future__ import annotations

import hashlib
import json
import sys

from dflashctl.agent.pack import PACKAGE, build

AGENT = build()
AGENT_SHA = hashlib.sha256(AGENT).hexdigest()

BOOT = (
    "import sys,os,hashlib,io,zipfile\n"
    "n=int(sys.argv.pop(1));h=sys.argv.pop(1);z=sys.stdin.buffer.read(n)\n"
    "if hashlib.sha256(z).hexdigest()!=h:\n"
    " sys.exit('dflashctl agent: %d bytes arrived, not the agent of hash %s'%(len(z),h))\n"
    "Z=zipfile.ZipFile(io.BytesIO(z));N=set(Z.namelist())\n"
    "class A:\n"
    " agent_bytes=z\n"
    " def find_spec(s,name,path=None,target=None):\n"
    "  b=name.replace('.','/')\n"
    "  for f,k in((b+'/__init__.py',1),(b+'.py',0)):\n"
    "   if f in N:\n"
    "    import importlib.util as u;return u.spec_from_loader(name,s,origin=f,is_package=bool(k))\n"
    " def create_module(s,spec):return None\n"
    " def exec_module(s,m):\n"
    "  f=m.__spec__.origin;m.__file__=os.path.join(sys.argv[0],f)\n"
    "  exec(compile(Z.read(f),m.__file__,'exec'),m.__dict__)\n"
    "sys.meta_path.insert(0,A())\n"
    "def home(d):\n"
    " os.makedirs(d,0o700,exist_ok=True);return d\n"
    "try:d=home(os.path.join(os.path.expanduser('~'),'.cache','dflashctl'))\n"
    "except OSError:import tempfile;d=home(os.path.join(tempfile.gettempdir(),'dflashctl-agent-%d'%os.getuid()))\n"
    "sys.argv[0]=os.path.join(d,'agent-'+h+'.pyz')\n"
    f"from {PACKAGE}.__main__ import main\n"
    "sys.exit(main())\n"
)


# -I (isolated, Python >= 3.4, so every Python the agent supports): no PYTHONPATH or other PYTHON* variables, no user
# site, and not the working directory first on sys.path (`-c` puts it there otherwise): a zipfile.py on the remote's
# PYTHONPATH or a hashlib.py in the login directory is never imported by the boot line before its hash check.
# -S: no `site` at all: a remote's sitecustomize or .pth hook that prints can never corrupt the JSON answer.
ISOLATED = ("-I", "-S")


def boot_argv(python: str, action: str, *args: str) -> list[str]:
    """The remote argv of one agent action; its stdin must start with AGENT. The interpreter runs isolated."""
    return [python, *ISOLATED, "-c", BOOT, str(len(AGENT)), AGENT_SHA, action, *args]


def shown_argv(python: str, action: str, *args: str) -> list[str]:
    """boot_argv as a person reads it: the boot line (a screenful) named, not printed."""
    return [
        python,
        *ISOLATED,
        "-c",
        f"<dflashctl agent boot line, sha256 {AGENT_SHA[:12]}>",
        str(len(AGENT)),
        AGENT_SHA,
        action,
        *args,
    ]


NOISE_SEEN: dict[str, bytes] = {}  # host name -> what its interpreter printed before the agent's answer, this run


def split_answer(stdout: bytes) -> tuple[bytes, bytes]:
    """(the agent's answer, what came before it): the answer is one line of compact JSON, written last. A `python:`
    wrapper or login script that prints a banner on stdout puts lines before it; they are not the agent's."""
    body = stdout.rstrip()
    try:
        json.loads(body)
        return stdout, b""
    except ValueError:
        pass
    noise, sep, last = body.rpartition(b"\n")
    if sep and last.startswith(b"{"):
        try:
            json.loads(last)
            return last, noise + sep
        except ValueError:
            pass
    return stdout, b""


def note_noise(host: str, noise: bytes) -> None:
    """One warning per host and run naming what was skipped (the first line of it), kept for `doctor`."""
    if not noise or host in NOISE_SEEN:
        return
    NOISE_SEEN[host] = noise
    first = noise.decode("utf-8", "replace").strip().splitlines()[0][:120] if noise.strip() else "blank lines"
    sys.stderr.write(
        f"dflashctl: warning: {host}: its Python printed {len(noise)} bytes on stdout before the "
        f"agent's answer (skipped): {first!r}; make the host's `python:` print nothing\n"
    )
