"""The layout rules of DESIGN.md that code review alone would let slip.

- ``gpubroker/store/`` is the only SQLAlchemy importer: the rest of the
  broker talks to the store through :class:`gpubroker.store.repository.Repository`
  and the store's ``*_repo`` modules;
- the pure core (``model/``, ``scheduler/`` and the device catalogues
  ``devices/mig.py`` and ``devices/models.py``) imports no I/O layer (store,
  device backends, engines, API, Tornado).

Imports are read from the source with :mod:`ast` (any ``import``, at module
level or inside a function), so an import hidden in a function counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "gpubroker"


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, as dotted names (relative imports resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    package = parts[:-1] if parts[-1] != "__init__" else parts
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _modules(under: str = "") -> list[Path]:
    return sorted(p for p in (PACKAGE / under).rglob("*.py") if "migrations" not in p.parts)


def _outside_store() -> list[Path]:
    return [p for p in _modules() if "store" not in p.relative_to(PACKAGE).parts[:1]]


def test_the_layout_scan_sees_imports() -> None:
    """The scan itself: the store imports SQLAlchemy, and the core imports
    the repository through a relative import."""
    assert "sqlalchemy" in {m.split(".")[0] for m in _imports(PACKAGE / "store" / "db.py")}
    assert "gpubroker.store.repository.Repository" in _imports(PACKAGE / "core.py")


@pytest.mark.parametrize("path", _outside_store(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_the_store_imports_sqlalchemy(path: Path) -> None:
    assert not [m for m in _imports(path) if m.split(".")[0] == "sqlalchemy"]


#: the device catalogues: pure data and rules, which the scheduler uses
CATALOGUES = ("gpubroker.devices.mig", "gpubroker.devices.models")
PURE = [
    *_modules("model"),
    *_modules("scheduler"),
    *(PACKAGE.parent / (name.replace(".", "/") + ".py") for name in CATALOGUES),
]


@pytest.mark.parametrize("path", PURE, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_pure_core_imports_no_io_layer(path: Path) -> None:
    banned = ("sqlalchemy", "tornado", "pynvml", "requests", "docker", "subprocess", "socket")
    inner = ("store", "devices", "engines", "api", "web", "broker", "enforce", "jobs")
    for module in _imports(path):
        top = module.split(".")
        assert top[0] not in banned, f"{path.name} imports {module}"
        if module.startswith(CATALOGUES) or module == "gpubroker.devices":
            continue  # the package of a catalogue: it loads its backends lazily
        if top[0] == "gpubroker" and len(top) > 1:
            assert top[1] not in inner, f"{path.name} imports {module}"


def test_the_broker_is_a_facade_over_parts_not_mixins() -> None:
    """``Broker`` derives from traitlets' configurable alone, and no module
    of the broker defines a mixin: its parts are objects it builds with
    explicit dependencies (DESIGN.md, the core v2 issue)."""
    from traitlets.config import LoggingConfigurable

    from gpubroker.core import Broker

    assert Broker.__bases__ == (LoggingConfigurable,)
    # the facade runs no command of its own: each is a part's (functools.wraps
    # of @command leaves __wrapped__ on the method)
    own = [name for name, value in vars(Broker).items() if hasattr(value, "__wrapped__")]
    assert not own, f"commands on the facade: {own}"
    for path in _modules():
        tree = ast.parse(path.read_text(), str(path))
        mixins = [
            n.name
            for n in ast.walk(tree)
            if isinstance(n, ast.ClassDef) and n.name.endswith("Mixin")
        ]
        assert not mixins, f"{path.relative_to(PACKAGE)} defines {mixins}"


def _bare_timeout_handlers(path: Path) -> list[int]:
    """Lines of ``path`` that catch or suppress the builtin ``TimeoutError``
    in a module that calls ``asyncio.wait_for``."""
    tree = ast.parse(path.read_text(), str(path))
    waits = any(isinstance(n, ast.Attribute) and n.attr == "wait_for" for n in ast.walk(tree))
    found = []
    for node in ast.walk(tree):
        names: list[ast.expr] = []
        if isinstance(node, ast.ExceptHandler) and node.type is not None:
            names = list(node.type.elts) if isinstance(node.type, ast.Tuple) else [node.type]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "suppress":
            names = list(node.args)
        if any(isinstance(n, ast.Name) and n.id == "TimeoutError" for n in names):
            found.append(node.lineno)
    return found if waits else []


@pytest.mark.parametrize(
    "path",
    [*_modules(), *sorted((PACKAGE.parent / "spawner").rglob("*.py"))],
    ids=lambda p: str(p.relative_to(PACKAGE.parent)),
)
def test_asyncio_timeouts_are_caught_as_asyncio_timeout_error(path: Path) -> None:
    """``asyncio.wait_for`` raises ``asyncio.TimeoutError``, which is the
    builtin ``TimeoutError`` only from Python 3.11; the project supports
    3.10, where ``except TimeoutError`` let the job service's loop die at
    its first idle wait (a review of the jobs)."""
    assert _bare_timeout_handlers(path) == []
