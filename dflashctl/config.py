"""Hosts: where they are defined, how they are typed, and how a host named on the command line is resolved.

Hosts come from, in order of precedence:
  1. `dflashctl.yaml` at the project's root (`hosts:` mapping),
  2. the user's `~/.config/dflashctl/hosts.yaml` (path overridable with $DFLASHCTL_HOSTS), same format,
  3. the built-in `local` host,
  4. a destination given directly: `user@host`, `ssh://[user@]host[:port]`, or an alias from ~/.ssh/config.
Every error names the file and the key, and exits with status 2.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import importlib
import os
import re
import sys
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin


def _no_pydantic_plugin_scan() -> None:
    """Pydantic asks its plugin loader for plugins whenever it builds a validator; the loader imports
    importlib.metadata (about 0.03 s) and scans every installed distribution's entry points (0.05 s) at the first
    model. dflashctl's models use none, so a loader with no plugins stands in for it in this process alone (the
    environment variable that also skips the scan would reach every job started from here). Where the real loader is
    already imported, its cache is seeded empty instead."""
    name = "pydantic.plugin._loader"
    loaded = sys.modules.get(name)
    if loaded is not None:
        if getattr(loaded, "_plugins", ()) is None:
            loaded._plugins = {}
        return
    none = types.ModuleType(name, "dflashctl: no pydantic plugins in this process")
    none.get_plugins = lambda: ()
    none._plugins = {}

    def real(attr: str):  # any other name (a later pydantic's): the real loader, imported then, answers it
        if attr.startswith("__"):
            raise AttributeError(attr)
        if sys.modules.get(name) is none:
            del sys.modules[name]
        loader = importlib.import_module(name)
        loader._plugins = loader._plugins if loader._plugins is not None else {}
        return getattr(loader, attr)

    none.__getattr__ = real
    sys.modules[name] = none


_no_pydantic_plugin_scan()

from pydantic import (  # noqa: E402
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from dflashctl.errors import ConfigError  # noqa: E402

PROJECT_FILE = "dflashctl.yaml"
USER_HOSTS_ENV = "DFLASHCTL_HOSTS"
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # always used with fullmatch: `$` would admit a newline
CONTAINER_SPEC = re.compile(r"pct:[0-9]+|docker:[A-Za-z0-9][A-Za-z0-9_.-]*")
# Top-level keys a hosts file may hold; dflashctl.yaml is read with the same rules.
PROJECT_KEYS = {"hosts"}
HOSTNAME = re.compile(r"[A-Za-z0-9_.:-]+")  # names, IPv4 and bare IPv6 literals; nothing a shell would read
SLURM_TIME = re.compile(r"(\d+-)?\d+(:\d{1,2}){0,2}|\d+-\d+")  # sbatch --time: MM, MM:SS, H:MM:SS, D-H[:MM[:SS]]
SBATCH_OPTION = re.compile(r"--([a-z][a-z-]*)(=[^\s\x00-\x1f]*)?")  # one long option: no space, never a newline
# what dflashctl sets itself, from the host's and the job's own keys: an extra option may not set it again
MANAGED_SBATCH = {
    "partition": "the host's `slurm.partition`",
    "account": "the host's `slurm.account`",
    "time": "`slurm.time`",
    "nodes": "`slurm.nodes`",
    "job-name": "the job's name",
    "output": "the run dir's slurm-ID.out",
    "error": "the run dir's slurm-ID.out",
    "open-mode": "dflashctl (append)",
    "chdir": "the run dir",
    "ntasks-per-node": "dflashctl (one per node)",
    "gpus-per-node": "the job's `gpus`",
    "array": "dflashctl (one job per submission)",
}


def _sbatch_options(value: list[str]) -> list[str]:
    """Extra sbatch options are `--name` or `--name=value`, one per item: each becomes one `#SBATCH` line, which
    sbatch splits on spaces (so a value with a space would smuggle in a second option), and none may set what
    dflashctl sets from its own keys (a partition the host file does not allow, another output file)."""
    for opt in value:
        m = SBATCH_OPTION.fullmatch(opt)
        if not m:
            raise ValueError(
                f"{opt!r}: expected one long sbatch option `--name` or `--name=value`, with no space "
                "(one option per item)"
            )
        if m[1] in MANAGED_SBATCH:
            raise ValueError(f"{opt!r}: --{m[1]} is set by {MANAGED_SBATCH[m[1]]}, not by an extra option")
    return value


def _destination_ok(value: str) -> bool:
    user, _, host = value.rpartition("@")
    return not ((user and not SAFE_NAME.fullmatch(user)) or not HOSTNAME.fullmatch(host))


def _slurm_time(value: str | None) -> str | None:
    if value is not None and not SLURM_TIME.fullmatch(value):
        raise ValueError("expected a Slurm time: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS")
    return value


# what a host and a job file both say to sbatch, checked alike
SbatchOptions = Annotated[list[str], AfterValidator(_sbatch_options)]
SlurmTime = Annotated[str | None, AfterValidator(_slurm_time)]


class SlurmHost(BaseModel):
    """A Slurm cluster reached through its login node: jobs are submitted with sbatch, not started in tmux."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    login: str | None = Field(None, description="the login node's ssh destination; none: this machine is one")

    @field_validator("login")
    @classmethod
    def _login(cls, value: str | None) -> str | None:
        if value is not None and not _destination_ok(value):
            raise ValueError("expected an ssh destination `host` or `user@host` with no shell characters")
        return value

    partition: str | None = Field(None, description="sbatch --partition; default: the cluster's default partition")
    account: str | None = Field(None, description="sbatch --account")
    time: SlurmTime = Field(None, description="wall time per submission (sbatch --time), e.g. 24:00:00")
    extra: SbatchOptions = Field(default_factory=list, description="more sbatch options, e.g. [--qos=high]")

    @field_validator("partition", "account")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is not None and not SAFE_NAME.fullmatch(value):
            raise ValueError("expected a name of [A-Za-z0-9._-]")
        return value


class HostConfig(BaseModel):
    """One remote (or the local machine): how to reach it and where its files live."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str = Field("", description="the host's name in the config, or the destination as given")
    ssh: str | None = Field(None, description="ssh destination: ~/.ssh/config alias, host or user@host; none = local")
    port: StrictInt | None = Field(None, ge=1, le=65535, description="ssh port; default from ~/.ssh/config, else 22")
    user: str | None = Field(None, description="ssh user; default from ~/.ssh/config or the destination")
    identity_file: str | None = Field(None, description="private key; default from ~/.ssh/config and the agent")
    container: str | None = Field(None, description="run commands inside `pct:<ctid>` or `docker:<name>`")
    workdir: str = Field("~/dflashctl", description="remote root for code/ and runs/; `~/` is the remote home")
    python: str = Field("python3", description="the remote Python that runs the trainer and the probe")
    gpu_query: Literal["container", "host"] = Field(
        "container", description="where nvidia-smi/NVML run: inside the container or on its host (Proxmox)"
    )
    connect_timeout: float = Field(10.0, gt=0, le=300, description="seconds to wait for the ssh handshake")
    rdzv_host: str | None = Field(
        None,
        description="the address other nodes reach this host at for a multi-node job's rendezvous (a "
        "container's own address differs from its host's); default: the ssh HostName, 127.0.0.1 for `local`",
    )
    slurm: SlurmHost | None = Field(None, description="a Slurm cluster: jobs go through sbatch on its login node")

    @model_validator(mode="before")
    @classmethod
    def _login_is_the_ssh_destination(cls, data: Any) -> Any:
        """A cluster's `slurm.login` is where dflashctl connects: it becomes `ssh` (given both, they must agree)."""
        slurm = data.get("slurm") if isinstance(data, dict) else None
        if isinstance(slurm, dict) and isinstance(slurm.get("login"), str) and _destination_ok(slurm["login"]):
            login = slurm["login"]  # a bad one is refused as `slurm.login`, where the file says it
            if data.get("ssh") not in (None, login):
                raise ValueError("`ssh` and `slurm.login` name different login nodes: give one")
            data = {**data, "ssh": login}
        return data

    @model_validator(mode="after")
    def _cluster_has_no_container(self) -> HostConfig:
        if self.slurm is not None and self.container is not None:
            raise ValueError("a Slurm host runs jobs through sbatch: `container` cannot be set with `slurm`")
        return self

    @field_validator("container")
    @classmethod
    def _container(cls, value: str | None) -> str | None:
        if value is not None and not CONTAINER_SPEC.fullmatch(value):
            raise ValueError("expected `pct:<ctid>` (digits) or `docker:<name>` ([A-Za-z0-9_.-])")
        return value

    @field_validator("ssh")
    @classmethod
    def _ssh(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not _destination_ok(value):
            raise ValueError("expected an ssh destination `host` or `user@host` with no shell characters")
        return value

    @field_validator("rdzv_host")
    @classmethod
    def _rdzv_host(cls, value: str | None) -> str | None:
        if value is not None and not HOSTNAME.fullmatch(value):
            raise ValueError("expected a host name or address with no shell characters")
        return value

    @field_validator("user")
    @classmethod
    def _user(cls, value: str | None) -> str | None:
        if value is not None and not SAFE_NAME.fullmatch(value):
            raise ValueError("expected a user name of [A-Za-z0-9._-]")
        return value

    @field_validator("workdir", "python")
    @classmethod
    def _no_control_chars(cls, value: str) -> str:
        if not value or any(ord(c) < 32 for c in value):
            raise ValueError("must be non-empty and hold no control characters")
        return value

    @property
    def is_local(self) -> bool:
        return self.ssh is None

    @property
    def container_kind(self) -> str | None:
        return self.container.split(":", 1)[0] if self.container else None

    @property
    def container_id(self) -> str | None:
        return self.container.split(":", 1)[1] if self.container else None


LOCAL = HostConfig(name="local", python=sys.executable)  # this machine: the interpreter running dflashctl


class HostsFile(BaseModel):
    """The `hosts:` part of dflashctl.yaml or the user's hosts.yaml."""

    model_config = ConfigDict(extra="forbid", defer_build=True)  # built at its first hosts file: never by `ls`

    hosts: dict[str, HostConfig] = Field(default_factory=dict)


def did_you_mean(word: str, choices: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The one of `choices` nearest to a misspelt `word` (difflib's ratio, at least `cutoff`), or None."""
    close = difflib.get_close_matches(word, sorted(set(choices)), n=1, cutoff=cutoff)
    return close[0] if close else None


def _alternatives(tp: Any) -> list[Any]:
    """The types a field's annotation stands for, with Optional, unions and Annotated opened."""
    origin = get_origin(tp)
    if origin is Annotated:
        return _alternatives(get_args(tp)[0])
    if origin in (Union, types.UnionType):
        return [alt for arg in get_args(tp) for alt in _alternatives(arg)]
    return [tp]


def _models(tp: Any) -> list[type[BaseModel]]:
    return [alt for alt in _alternatives(tp) if isinstance(alt, type) and issubclass(alt, BaseModel)]


def keys_at(model: Any, loc: Iterable) -> list[str]:
    """The keys a model allows at an error's location (pydantic's `loc` less its last part): the fields of the model
    found by walking fields, list items and mapping values from `model`; none where the walk finds no model."""
    tp = model
    for part in loc:
        if _type_tag(part):
            continue
        step = None
        for alt in _alternatives(tp):
            if alt in _models(alt) and isinstance(part, str) and part in alt.model_fields:
                step = alt.model_fields[part].annotation
            elif get_origin(alt) in (list, tuple) and isinstance(part, int):
                step = get_args(alt)[0]
            elif get_origin(alt) is dict and isinstance(part, str):
                step = get_args(alt)[1]
            if step is not None:
                break
        if step is None:
            return []
        tp = step
    return [name for m in _models(tp) for name in m.model_fields]


def format_validation_error(source: str, err: ValidationError, prefix: str = "", model: Any = None) -> ConfigError:
    """One line naming the file and the dotted key of every problem pydantic found; an unknown key is pointed at the
    nearest key `model` allows there (`comand` -> `command`)."""
    said: dict[str, list[str]] = {}
    for e in err.errors():
        # a union's members appear in the location as type tags (`gpus.list[int]`, `gpus.int`): the key as the
        # file has it is what remains
        loc = [p for p in (prefix, *e["loc"]) if p != "" and not _type_tag(p)]
        key = ".".join(str(p) for p in loc)
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            near = did_you_mean(str(e["loc"][-1]), keys_at(model, e["loc"][:-1])) if model is not None else None
            msg = f"unknown key (did you mean `{near}`?)" if near else "unknown key"
        elif e["type"] == "missing":
            msg = "required key is missing"
        said.setdefault(key, [])
        if msg not in said[key]:
            said[key].append(msg)
    parts = []
    for key, msgs in said.items():
        options = [m.removeprefix("Input should be ") for m in msgs]
        msg = msgs[0] if len(msgs) == 1 else "expected " + " or ".join(options)
        parts.append(f"{key}: {msg}" if key else msg)
    return ConfigError(source, None, "; ".join(parts))


TYPE_TAGS = {"int", "str", "float", "bool", "list", "dict", "none", "constrained-int", "constrained-float"}


def _type_tag(part) -> bool:
    """A pydantic union member's tag in an error's location, not a key of the file."""
    return isinstance(part, str) and (part in TYPE_TAGS or "[" in part or part.startswith("function-"))


MAX_CONFIG_BYTES = 1 << 20  # job and host files are a few KiB; anything this large is not one
MAX_NESTING = 64


@functools.cache
def _strict_loader():
    """safe_load's loader, but a key given twice in one mapping is an error (YAML keys are unique; PyYAML keeps the
    last). Built at the first file read: a command that reads none (`--help`, `ls`) never imports PyYAML."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                except TypeError:
                    raise yaml.constructor.ConstructorError(None, None, "unhashable key", key_node.start_mark) from None
                if duplicate:
                    raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)

    return StrictLoader


def _depth(text: str) -> int:
    """An upper bound of the nesting of flow collections and indentation, checked before parsing (deep input makes
    PyYAML recurse until the interpreter gives up)."""
    depth = best = 0
    for ch in text:
        if ch in "[{":
            depth += 1
            best = max(best, depth)
        elif ch in "]}":
            depth = max(0, depth - 1)
    indents = {len(line) - len(line.lstrip(" ")) for line in text.splitlines() if line.strip()}
    return max(best, len(indents))


KEY_LINE = re.compile(r"\s*(?:-\s+)?([A-Za-z_][A-Za-z0-9_.-]*):(?:\s+(.*))?")  # `key: value`, `- key:`


def _colon_hint(text: str, line: int) -> tuple[str | None, str]:
    """(key, hint) for "mapping values are not allowed here": a plain value holding `: ` (a command's `--msg a: b`)
    reads as a second key. The key is that of the line YAML stopped on, or of the nearest line above it that is less
    indented (a value continued over several lines)."""
    lines = text.splitlines()
    here = lines[line] if 0 <= line < len(lines) else ""
    indent = len(here) - len(here.lstrip())
    for at in range(min(line, len(lines) - 1), -1, -1):
        m = KEY_LINE.fullmatch(lines[at].rstrip())
        if m and (at == line or len(lines[at]) - len(lines[at].lstrip()) < indent):
            key, value = m[1], m[2] or ""
            if value.startswith(("{", "[")):  # inside a flow mapping or list: only quotes help
                return key, '; inside `{ }` or `[ ]` a value holding `: ` must be quoted ("x: y")'
            return key, (
                f"; the value of `{key}` holds `: `: write it as a block, `{key}: |` with the value on the "
                "next lines indented, or quote it"
            )
    return None, "; a value holding `: ` must be written as a block (`key: |`, the value on the next lines) or quoted"


def load_yaml(path: Path) -> Any:
    """Parse a YAML file; a syntax error becomes a ConfigError with the line number. Binary or non-UTF-8 files,
    duplicate keys, very deep nesting and huge files are refused the same way."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(str(path), None, f"cannot read: {e.strerror}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(str(path), None, f"too large for a config file ({len(raw)} bytes)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(str(path), None, f"not UTF-8 text (byte {e.start})") from None
    if "\0" in text:
        raise ConfigError(str(path), None, "binary file (holds NUL bytes)")
    if _depth(text) > MAX_NESTING:
        raise ConfigError(str(path), None, f"nested deeper than {MAX_NESTING} levels")
    import yaml

    try:
        return yaml.load(text, Loader=_strict_loader())  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        colon = "mapping values are not allowed" in problem or "but got ':'" in problem
        key, hint = _colon_hint(text, mark.line) if mark and colon else (None, "")
        raise ConfigError(where, key, f"malformed YAML: {problem}{hint}") from None
    except RecursionError:
        raise ConfigError(str(path), None, "nested too deeply") from None


def load_hosts_file(path: Path) -> dict[str, HostConfig]:
    data = load_yaml(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(str(path), None, "expected a mapping with a `hosts:` key")
    unknown = sorted(str(k) for k in set(data) - PROJECT_KEYS)
    if unknown:
        near = did_you_mean(unknown[0], PROJECT_KEYS)
        raise ConfigError(str(path), unknown[0], f"unknown key (did you mean `{near}`?)" if near else "unknown key")
    raw = data.get("hosts") or {}
    if not isinstance(raw, dict):
        raise ConfigError(str(path), "hosts", "expected a mapping of host name to host settings")
    for name in raw:
        if not isinstance(name, str) or not SAFE_NAME.fullmatch(name):
            raise ConfigError(str(path), f"hosts.{name}", "host names may hold only [A-Za-z0-9._-]")
        if name == "local":
            raise ConfigError(str(path), "hosts.local", "`local` is built in and cannot be redefined")
    try:
        parsed = HostsFile.model_validate({"hosts": raw})
    except ValidationError as e:
        raise format_validation_error(str(path), e, model=HostsFile) from None
    return {name: host.model_copy(update={"name": name}) for name, host in parsed.hosts.items()}


def find_project_root(start: Path | None = None) -> Path:
    """The nearest directory holding dflashctl.yaml or .git, else the start directory."""
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / PROJECT_FILE).is_file() or (d / ".git").exists():
            return d
    return here


def user_hosts_path() -> Path:
    override = os.environ.get(USER_HOSTS_ENV)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "dflashctl" / "hosts.yaml"


def known_hosts(project_root: Path | None = None) -> dict[str, HostConfig]:
    """All named hosts: the user's file first, the project's file overriding it by name."""
    hosts: dict[str, HostConfig] = {}
    user_file = user_hosts_path()
    if user_file.is_file():
        hosts.update(load_hosts_file(user_file))
    project_file = find_project_root(project_root) / PROJECT_FILE
    if project_file.is_file():
        hosts.update(load_hosts_file(project_file))
    return hosts


def parse_destination(spec: str) -> HostConfig:
    """A host given directly: `user@host`, `ssh://[user@]host[:port]`, or a bare ssh alias."""
    port: int | None = None
    dest = spec
    if spec.startswith("ssh://"):
        rest = spec[len("ssh://") :].rstrip("/")
        m = re.fullmatch(r"^(?:(?P<user>[^@]+)@)?(?P<host>\[[^\]]+\]|[^:]+)(?::(?P<port>[0-9]+))?$", rest)
        if not m:
            raise ConfigError("command line", "host", f"cannot parse {spec!r}: expected ssh://[user@]host[:port]")
        host = m["host"].strip("[]")
        dest = f"{m['user']}@{host}" if m["user"] else host
        port = int(m["port"]) if m["port"] else None
    try:
        return HostConfig(name=spec, ssh=dest, port=port)
    except ValidationError as e:
        raise format_validation_error("command line", e, prefix="host", model=HostConfig) from None


IP_ADDRESS = re.compile(r"[0-9.]+|[0-9A-Fa-f:]*:[0-9A-Fa-f:.]*")


def _ssh_config_hosts() -> list[str]:
    """The `Host` patterns of the user's ~/.ssh/config (its Include files are not followed), `*` and negations left
    out: a name one of them matches is an ssh alias, never a typo of ours."""
    try:
        text = (Path.home() / ".ssh" / "config").read_text(errors="replace")
    except OSError:
        return []
    found = []
    for line in text.splitlines():
        words = line.strip().replace("=", " ", 1).split()
        if len(words) > 1 and words[0].lower() == "host":
            found += [w for w in words[1:] if w != "*" and not w.startswith("!")]
    return found


def misspelt_host(spec: str, named: Iterable[str]) -> str | None:
    """The host name `spec` is most likely a typo of (`lcoal` -> `local`), or None. Only a bare name that is none of
    ours, not `local`, no address and no ~/.ssh/config alias, within difflib's reach of one of ours and about as
    long (`localhost` is not a typo of `local`); `user@host` or `ssh://host` is always taken as written."""
    names = {*named, "local"}
    if spec in names or not SAFE_NAME.fullmatch(spec) or IP_ADDRESS.fullmatch(spec):
        return None
    near = [n for n in difflib.get_close_matches(spec, sorted(names), n=3, cutoff=0.75) if abs(len(n) - len(spec)) <= 2]
    if not near or any(fnmatch.fnmatchcase(spec, pattern) for pattern in _ssh_config_hosts()):
        return None
    return near[0]


def unknown_host_message(spec: str, near: str, command_line: bool = True) -> str:
    """What a misspelt host is told: the nearest name, and how to mean a new host of that name after all."""
    other = f", or give it as user@{spec} or ssh://{spec}" if command_line else ""
    return (
        f"no host `{spec}` in dflashctl.yaml, hosts.yaml or ~/.ssh/config: did you mean `{near}`? (a host of that "
        f"name: add it to dflashctl.yaml's `hosts:`{other})"
    )


def resolve_host(spec: str, project_root: Path | None = None, workdir: str | None = None) -> HostConfig:
    """Turn what the user typed into a HostConfig; `workdir` overrides the host's own. A bare name one letter or two
    from a host of ours is refused with that name, never tried as an ssh destination."""
    if not spec or any(ord(c) < 32 for c in spec):
        raise ConfigError("command line", "host", "empty or holds control characters")
    named = known_hosts(project_root)
    if spec in named:
        host = named[spec]
    elif spec == "local":
        host = LOCAL
    else:
        near = misspelt_host(spec, named)
        if near:
            raise ConfigError("command line", "host", unknown_host_message(spec, near))
        host = parse_destination(spec)
    if workdir is not None:
        try:
            host = HostConfig.model_validate({**host.model_dump(), "workdir": workdir})
        except ValidationError:
            raise ConfigError("command line", "--workdir", "must be non-empty with no control characters") from None
    return host
