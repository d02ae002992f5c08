"""Start-up without what this CLI never draws: Typer's help module imports `rich.markdown` (and with it
markdown-it, a tenth of a second on a 2-core machine) and `rich.traceback` at import, for a Markdown help mode and
pretty tracebacks that this app turns off (`rich_markup_mode="rich"`, `pretty_exceptions_enable=False`).

`defer_unused_rich()` puts a stand-in for each in `sys.modules` before Typer is imported. The stand-in's classes
load the real module the moment anything is built from them, and any other name falls through to it, so a user of
either (a plugin, a later Typer that does draw Markdown) gets the real thing, only later.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types

# module -> the names Typer takes from it with `from module import name` (classes: Typer annotates with them)
DEFERRED = {"rich.markdown": ("Markdown",), "rich.traceback": ("Traceback",)}


def _stand_in(module: str, names: tuple[str, ...]) -> types.ModuleType:
    stub = types.ModuleType(module)
    stub.__doc__ = f"stand-in for {module}, loaded on first use (dflashctl.show.fast_start)"
    stub.__spec__ = importlib.machinery.ModuleSpec(module, None)

    def real() -> types.ModuleType:
        if sys.modules.get(module) is stub:
            del sys.modules[module]
        return importlib.import_module(module)

    class Deferred:
        """Builds the real class: `Name(...)` and `Name.attr` both load the module."""

        def __new__(cls, *args, **kwargs):
            return getattr(real(), cls.__name__)(*args, **kwargs)

    def attr(name: str):
        if name.startswith("__"):  # the import system's own questions (__spec__, __path__): no reason to load
            raise AttributeError(name)
        return getattr(real(), name)

    for name in names:
        meta = type(f"{name}Meta", (type,), {"__getattr__": lambda cls, a: getattr(attr(cls.__name__), a)})
        setattr(stub, name, meta(name, (Deferred,), {"__module__": module, "__qualname__": name}))
    stub.__getattr__ = attr  # any other name: the real module's
    return stub


def defer_unused_rich() -> None:
    """Install the stand-ins, unless the real modules are loaded already."""
    for module, names in DEFERRED.items():
        if module not in sys.modules:
            sys.modules[module] = _stand_in(module, names)
