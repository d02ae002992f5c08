"""The remote agent as one zipapp, built here byte for byte the same every time, and the boot line that runs it.

Each remote command sends the zipapp on stdin ahead of its own payload: `python3 -c BOOT LEN SHA ACTION ...`. BOOT
reads LEN bytes, checks their SHA-256, keeps them as ~/.cache/dflashctl/agent-SHA.pyz (0700 dir, 0600 file, written
atomically; a cached copy is checked again before use), and runs it with the rest of stdin left to the action: from
its files unpacked beside it (`agent-SHA/`, byte-compiled once; their digest, taken from the checked archive, is
compared at every call; a zipapp's modules are compiled again at every import, about 0.1 s a call here), else from
the archive itself, by importing its package's `__main__` (runpy would cost another 10 ms of imports). So
the remote needs nothing installed, never runs a copy that differs from this client's, and a job's tmux pane can run
the launcher from a file (`agent.pyz`, copied into the run dir at launch).
"""

from __future__ import annotations

import hashlib

from dflashctl.agent.pack import PACKAGE, build

AGENT = build()
AGENT_SHA = hashlib.sha256(AGENT).hexdigest()

BOOT = (
    "import sys,os,hashlib\n"
    "n=int(sys.argv.pop(1));h=sys.argv.pop(1);z=sys.stdin.buffer.read(n)\n"
    "if hashlib.sha256(z).hexdigest()!=h:\n"
    " sys.exit('dflashctl agent: %d bytes arrived, not the agent of hash %s'%(len(z),h))\n"
    "def keep(d):\n"
    " os.makedirs(d,0o700,exist_ok=True);p=os.path.join(d,'agent-'+h+'.pyz')\n"
    " try:\n"
    "  with open(p,'rb') as f:\n"
    "   if hashlib.sha256(f.read()).hexdigest()==h:return p\n"
    " except OSError:pass\n"
    " t='%s.%d'%(p,os.getpid());fd=os.open(t,os.O_WRONLY|os.O_CREAT|os.O_TRUNC,0o600)\n"
    " with os.fdopen(fd,'wb') as f:f.write(z)\n"
    " os.replace(t,p);return p\n"
    "def digest(d):\n"
    " g=hashlib.sha256()\n"
    " for r,ds,fs in os.walk(d):\n"
    "  ds[:]=sorted(x for x in ds if x!='__pycache__')\n"
    "  for x in sorted(fs):\n"
    "   if x.endswith('.py'):\n"
    "    q=os.path.join(r,x)\n"
    "    with open(q,'rb') as f:g.update(os.path.relpath(q,d).encode()+b'\\0'+f.read())\n"
    " return g.hexdigest()\n"
    "def tree(p):\n"
    " d=p[:-4]\n"
    " try:\n"
    "  with open(os.path.join(d,'.digest')) as f:\n"
    "   if f.read()==digest(d):return d\n"
    "  return p\n"
    " except OSError:pass\n"
    " t='%s.%d'%(d,os.getpid())\n"
    " try:\n"
    "  import compileall,io,zipfile;zipfile.ZipFile(io.BytesIO(z)).extractall(t);compileall.compile_dir(t,quiet=2)\n"
    "  with open(os.path.join(t,'.digest'),'w') as f:f.write(digest(t))\n"
    "  os.rename(t,d);return d\n"
    " except OSError:\n"
    "  import shutil;shutil.rmtree(t,True);return p\n"
    "try:p=keep(os.path.join(os.path.expanduser('~'),'.cache','dflashctl'))\n"
    "except OSError:import tempfile;p=keep(os.path.join(tempfile.gettempdir(),'dflashctl-agent-%d'%os.getuid()))\n"
    "sys.argv[0]=p;sys.path.insert(0,tree(p))\n"
    f"from {PACKAGE}.__main__ import main\n"
    "sys.exit(main())\n"
)


def boot_argv(python: str, action: str, *args: str) -> list[str]:
    """The remote argv of one agent action; its stdin must start with AGENT. `-S`: the agent is stdlib only, so the
    interpreter skips `site`: a remote's sitecustomize or .pth hook that prints can never corrupt its JSON answer."""
    return [python, "-S", "-c", BOOT, str(len(AGENT)), AGENT_SHA, action, *args]
