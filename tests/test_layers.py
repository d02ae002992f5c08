"""The house's rules, read from the source: the agents shipped to the remote use the standard library only, the
judge is pure, dflashctl and the trainer never import each other, and no two dflashctl modules import each other."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STDLIB = set(sys.stdlib_module_names)


def imports(path: Path, relative: bool = True) -> set[str]:
    """Every module a file imports, at any depth (a lazy import inside a function counts); a relative import is
    resolved against the file's package (left out with relative=False)."""
    found = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or node.level):
            if node.level and not relative:
                continue
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
            module = ".".join(x for x in (base, node.module) if x)
            found.add(module)
            found |= {f"{module}.{a.name}" for a in node.names}
    return found


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def test_the_remote_agent_is_one_package_of_the_standard_library_and_itself():
    """What runs on the remote's own Python: stdlib (pynvml optional, inside a try), its own modules and the pure
    judge, imported relatively so that the same files work as dflashctl.agent here and as the zipapp's package
    there (which ships the judge inside it)."""
    files = sorted((ROOT / "dflashctl" / "agent").glob("*.py"))
    assert {p.stem for p in files} >= {"__init__", "__main__", "common", "pack", "probe", "release", "launcher"}
    for path in files:
        outside = {m.split(".")[0] for m in imports(path, relative=False)} - STDLIB - {"__future__", "pynvml"}
        assert outside == set(), (path.name, outside)
        assert not any(m.startswith("dflashctl") for m in imports(path, relative=False)), path.name
    graph = import_graph("dflashctl")
    agent = {
        m: {d for d in deps if d.startswith("dflashctl.agent")}
        for m, deps in graph.items()
        if m.startswith("dflashctl.agent")
    }
    assert_no_cycle(agent)
    # beyond itself, the agent imports only the pure judge (shipped inside its zipapp for the supervisor)
    assert {d for m in agent for d in graph[m] if not d.startswith("dflashctl.agent")} <= {
        m for m in graph if m.startswith("dflashctl.judge")
    }
    assert not (ROOT / "dflashctl" / "remote" / "probe.py").exists()  # one agent, not three shipped alone


IMPURE_MODULES = {"os", "time", "subprocess", "socket", "shutil", "pathlib", "io", "datetime", "random"}
IMPURE_CALLS = {"open", "input", "print", "exec", "eval", "__import__"}


def test_the_judge_is_pure():
    """No I/O and no clock in judge/: `now` and every elapsed time are passed in, by whoever measures them."""
    for path in (ROOT / "dflashctl" / "judge").glob("*.py"):
        outside = {m for m in imports(path) if m.split(".")[0] not in STDLIB | {"__future__"}}
        assert all(m.startswith("dflashctl.judge") for m in outside), (path.name, outside)
        assert not {m.split(".")[0] for m in imports(path)} & IMPURE_MODULES, path.name
        calls = {
            n.func.id
            for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
        }
        assert not calls & IMPURE_CALLS, (path.name, calls & IMPURE_CALLS)


def test_dflashctl_and_the_trainer_never_import_each_other():
    for pkg, other in (("dflashctl", "trainer"), ("trainer", "dflashctl")):
        for path in (ROOT / pkg).rglob("*.py"):
            assert not any(m == other or m.startswith(other + ".") for m in imports(path)), path


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (`from a.b import c` counts as a.b.c when c is a module, else a.b);
    package __init__ files left out."""
    mods = {module_name(p): p for p in (ROOT / package).rglob("*.py")}
    graph = {}
    for m, p in mods.items():
        deps = set()
        for i in imports(p):
            target = i if i in mods else i.rsplit(".", 1)[0]
            if target in mods and target != m and mods[target].name != "__init__.py":
                deps.add(target)
        graph[m] = deps
    return graph


def assert_no_cycle(graph: dict[str, set[str]]) -> None:
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in graph[m]:
            assert state.get(n) != 1, " -> ".join(path + [m, n])
            if n not in state:
                visit(n, path + [m])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [])


def test_no_import_cycle_between_dflashctl_modules():
    assert_no_cycle(import_graph("dflashctl"))


TRAINER_LAYERS = {"errors": 0, "config": 0, "model": 1, "data": 2, "run": 3, "serve": 4}  # entry points on top


def trainer_layer(module: str) -> int:
    parts = module.split(".")
    return TRAINER_LAYERS.get(parts[1], 5) if len(parts) > 1 else 5


def test_the_trainer_is_grouped_by_layer_with_no_arrow_up_and_no_circle():
    mods = {module_name(p): p for p in (ROOT / "trainer").rglob("*.py")}
    assert {m.split(".")[1] for m in mods if m.count(".") >= 2} == {"model", "data", "run", "serve"}
    flat = [m for m in mods if m.count(".") == 1 and mods[m].name != "__init__.py"]
    assert sorted(flat) == [
        "trainer.bench_tau",
        "trainer.config",
        "trainer.errors",
        "trainer.export",
        "trainer.regenerate",
        "trainer.tiny",
        "trainer.train",
    ]  # bottom, and the entry points
    graph = import_graph("trainer")
    for m, deps in graph.items():
        for d in deps:
            assert trainer_layer(d) <= trainer_layer(m), f"{m} imports {d}: an arrow up"
    assert_no_cycle(graph)


CLI_LAYERS = {
    "agent": -1,
    "errors": 0,
    "config": 0,
    "outputs": 0,
    "logfile": 0,
    "safe_write": 0,
    "model": 0,
    "judge": -2,
    "remote": 1,
    "jobs": 2,
    "show": 3,
}


def test_dflashctl_has_no_arrow_up_between_its_layers():
    """The remote agent under everything (it imports only itself); judge, the job model and config at the bottom;
    remote above them; jobs above remote; show and cli on top."""

    def layer(m: str) -> int:
        parts = m.split(".")
        return CLI_LAYERS.get(parts[1], 4) if len(parts) > 1 else 4

    for m, deps in import_graph("dflashctl").items():
        for d in deps:
            assert layer(d) <= layer(m), f"{m} imports {d}: an arrow up"
