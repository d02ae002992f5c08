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


def boot_argv(python: str, action: str, *args: str) -> list[str]:
    """The remote argv of one agent action; its stdin must start with AGENT. `-S`: the agent is stdlib only, so the
    interpreter skips `site`: a remote's sitecustomize or .pth hook that prints can never corrupt its JSON answer."""
    return [python, "-S", "-c", BOOT, str(len(AGENT)), AGENT_SHA, action, *args]
