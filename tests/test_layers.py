"""The package's layering, checked over its source: layer order, no cycle, no private name across modules.

Every import counts: module level and inside functions, ``import x``, ``from x import y``,
relative imports (resolved against the importing module), and ``importlib.import_module``
or ``__import__`` with a literal name. The layers, lowest first, and what each may import
of the package (its own layer always included):

==============  ===========================================================================
kernels         nothing of the package; of the outside world only the standard library,
                numpy and numba (llvmlite, numba's code generator, for ``@intrinsic``)
core            kernels (``core/errors.py``, ``core/version.py``, ``core/logs.py``: nothing of the package)
books           core, kernels; never ``torch.distributed``
comm            books, core, kernels
checkpoint      books, core, kernels; never comm, never ``torch.distributed``
integrations    comm, checkpoint, books, core, kernels
tools           every layer; nothing outside tools (and ``__main__``) imports tools
root facades    ``__init__``: only core.errors, core.version and core.logs (the rest lazily);
                ``ddp``, ``fsdp``, ``deepspeed``, ``collectives``: re-exports of comm;
                ``__main__``: tools
==============  ===========================================================================

No module imports the package root itself (``import comm_codec``, ``from comm_codec import
X``, ``from .. import X`` reaching the root): its ``__init__`` is a lazy facade for users.

A private name is one that starts with ``_`` and is not a dunder. None crosses modules: not
``from .x import _y``, not ``x._y`` on an imported package module, and not ``obj._y`` (nor
``getattr(obj, "_y")``) where ``_y`` is defined -- as a function or method, a class
attribute, or a ``self._y = ...`` assignment -- in another module of the package and not in
the accessing module (``self._y`` and ``cls._y`` are the class's own business).

The checker runs on any directory laid out like the package; the tests at the end run it
on small synthetic packages so that none of the real-package assertions can pass vacuously.
"""

from __future__ import annotations

import ast
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "comm_codec"
MAX_LINES = 900

# layer -> the package layers its modules may import (besides their own)
LAYER_IMPORTS = {
    "kernels": set(),
    "core": {"kernels"},
    "books": {"core", "kernels"},
    "comm": {"books", "core", "kernels"},
    "checkpoint": {"books", "core", "kernels"},
    "integrations": {"comm", "checkpoint", "books", "core", "kernels"},
    "tools": {"kernels", "core", "books", "comm", "checkpoint", "integrations", "facade"},
    "facade": {"comm", "checkpoint"},
    "main": {"tools"},
    "root": set(),  # see ROOT_EAGER
}
FACADES = {"ddp", "fsdp", "deepspeed", "collectives", "dcp"}
ROOT_EAGER = {f"{PACKAGE}.core.errors", f"{PACKAGE}.core.version", f"{PACKAGE}.core.logs"}  # what __init__ may import
ISOLATED = {
    f"{PACKAGE}.core.errors",
    f"{PACKAGE}.core.version",
    f"{PACKAGE}.core.logs",
}  # import nothing of the package
# layer -> the only outside top-level packages it may import (absent: any)
EXTERNAL_ALLOWED = {"kernels": set(sys.stdlib_module_names) | {"numpy", "numba", "llvmlite"}}
# layer -> outside modules it must never import (the module or anything under it)
EXTERNAL_FORBIDDEN = {"books": ("torch.distributed",), "checkpoint": ("torch.distributed",)}
# module -> outside modules it may import although its layer forbids them: the DCP storage
# subclasses torch.distributed.checkpoint's reader and writer (and nothing else of torch.distributed)
EXTERNAL_EXEMPT = {
    f"{PACKAGE}.checkpoint.dcp": ("torch.distributed.checkpoint",),
    f"{PACKAGE}.checkpoint._dcp_metadata": ("torch.distributed.checkpoint",),
}
# the public API of namedtuples, which is spelled with an underscore
NAMEDTUPLE_API = {"_asdict", "_replace", "_fields", "_field_defaults", "_make"}


# -- reading the package ---------------------------------------------------------------------
@dataclass
class Module:
    name: str  # dotted, e.g. comm_codec.core.codec ("comm_codec" for the root __init__)
    path: Path
    is_pkg: bool
    tree: ast.Module
    nlines: int
    shown: str  # the path as messages show it


@dataclass(frozen=True)
class Import:
    line: int
    target: str  # the absolute module (or package) imported from
    name: str | None = None  # for ``from target import name``: the name
    module: str | None = None  # the package module this import makes an edge to, if any


@dataclass
class Package:
    root: Path  # the package directory
    modules: dict[str, Module] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.root.name


def load_package(root: Path, shown_from: Path | None = None) -> Package:
    """Parse every ``.py`` file under ``root`` (a package directory) into a :class:`Package`."""
    root = Path(root)
    pkg = Package(root)
    base = shown_from if shown_from is not None else root.parent
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts.pop()
        text = path.read_text(encoding="utf-8")
        name = ".".join(parts)
        pkg.modules[name] = Module(
            name, path, is_pkg, ast.parse(text, str(path)), len(text.splitlines()), str(path.relative_to(base))
        )
    return pkg


def _resolve(mod: Module, level: int, name: str | None) -> str:
    """Return the absolute name that ``from <level dots><name> import ...`` in ``mod`` means."""
    if level == 0:
        return name or ""
    parts = mod.name.split(".")
    base = parts if mod.is_pkg else parts[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _literal_import(node: ast.Call) -> str | None:
    """The literal module name of ``importlib.import_module("x", package)`` / ``__import__("x")``."""
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if called not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def _literal_import_anchor(mod: Module, node: ast.Call) -> str | None:
    """The anchor package of a relative ``import_module(".x", __name__ or __package__)``, or None."""
    rest = node.args[1:] + [k.value for k in node.keywords if k.arg == "package"]
    if not rest or not isinstance(rest[0], ast.Name):
        return None
    if rest[0].id == "__name__":
        return mod.name
    if rest[0].id == "__package__":
        return mod.name if mod.is_pkg else mod.name.rpartition(".")[0]
    return None


def imports_of(pkg: Package, mod: Module) -> list[Import]:
    """Every import in ``mod``, anywhere in it, with targets resolved to absolute names."""
    out = []
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append(Import(node.lineno, alias.name, None, alias.name if alias.name in pkg.modules else None))
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(mod, node.level, node.module)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in pkg.modules:
                    out.append(Import(node.lineno, target, alias.name, sub))
                else:
                    out.append(Import(node.lineno, target, alias.name, target if target in pkg.modules else None))
        elif isinstance(node, ast.Call):
            name = _literal_import(node)
            if name is None:
                continue
            if name.startswith("."):  # importlib's rule: strip level - 1 parts off the anchor
                level = len(name) - len(name.lstrip("."))
                anchor = _literal_import_anchor(mod, node)
                if anchor is None:
                    continue
                base = anchor.rsplit(".", level - 1)[0]
                name = f"{base}.{name[level:]}" if name[level:] else base
            out.append(Import(node.lineno, name, None, name if name in pkg.modules else None))
    return out


def layer_of(pkg: Package, name: str) -> str:
    """The layer of a package module name: a subpackage's name, or root / facade / main / ``?``."""
    parts = name.split(".")
    if parts == [pkg.name]:
        return "root"
    if parts[0] != pkg.name:
        return "outside"
    first = parts[1]
    if first == "__main__":
        return "main"
    if (
        first in FACADES
        and len(parts) == 2
        and f"{pkg.name}.{first}" in pkg.modules
        and not pkg.modules[f"{pkg.name}.{first}"].is_pkg
    ):
        return "facade"
    if first in LAYER_IMPORTS:
        return first
    return "?"


def _is_package(pkg: Package, name: str) -> bool:
    return name == pkg.name or name.startswith(pkg.name + ".")


# -- the checks ------------------------------------------------------------------------------
def check_layers(pkg: Package) -> list[str]:
    """Every import that breaks the layer order, the root rule or the outside-import rules."""
    bad = []
    for mod in pkg.modules.values():
        layer = layer_of(pkg, mod.name)
        if layer == "?":
            bad.append(f"{mod.shown}:1: module {mod.name} is in no layer (add it to a layer subpackage)")
            continue
        for imp in imports_of(pkg, mod):
            where = f"{mod.shown}:{imp.line}"
            if not _is_package(pkg, imp.target):
                top = imp.target.split(".")[0]
                allowed = EXTERNAL_ALLOWED.get(layer)
                if allowed is not None and top not in allowed:
                    bad.append(
                        f"{where}: {layer} imports {imp.target} (a {layer} module may import only "
                        f"the standard library and {', '.join(sorted(allowed - set(sys.stdlib_module_names)))})"
                    )
                full = imp.target if imp.name is None else f"{imp.target}.{imp.name}"
                exempt = EXTERNAL_EXEMPT.get(mod.name, ())
                for banned in EXTERNAL_FORBIDDEN.get(layer, ()):
                    if any(imp.target == e or imp.target.startswith(e + ".") for e in exempt):
                        continue
                    if any(x == banned or x.startswith(banned + ".") for x in (full, imp.target)):
                        bad.append(f"{where}: {layer} imports {full} (a {layer} module never uses {banned})")
                continue
            dep = imp.module or imp.target
            what = imp.target if imp.name is None else f"from {imp.target} import {imp.name}"
            if dep == mod.name:
                continue
            if dep == pkg.name:
                bad.append(f"{where}: imports the package root ({what}); import the module that defines the name")
                continue
            if mod.name in ISOLATED:
                bad.append(f"{where}: {mod.name} imports {what} ({mod.name} imports nothing of the package)")
                continue
            if layer == "root":
                if dep not in ROOT_EAGER:
                    bad.append(
                        f"{where}: the package root imports {what} eagerly (only "
                        f"{', '.join(sorted(ROOT_EAGER))}; load the rest lazily)"
                    )
                continue
            dep_layer = layer_of(pkg, dep)
            if dep_layer == layer:
                continue
            if dep_layer == "tools" and layer not in ("tools", "main"):
                bad.append(f"{where}: {layer} imports {what} (nothing outside tools imports tools)")
            elif dep_layer not in LAYER_IMPORTS[layer]:
                allowed = ", ".join(sorted(LAYER_IMPORTS[layer])) or "nothing of the package"
                bad.append(f"{where}: {layer} imports {what} ({dep_layer} layer; {layer} may import {allowed})")
    return bad


def find_cycles(pkg: Package) -> list[list[str]]:
    """The import cycles: strongly connected components of the module graph (Tarjan), with more than one module
    or a module that imports itself."""
    edges = {m: sorted({i.module for i in imports_of(pkg, mod) if i.module}) for m, mod in pkg.modules.items()}
    index, low, stack, on_stack, sccs = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(edges) + 100))
    try:
        for v in sorted(edges):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(sccs)


def check_cycles(pkg: Package) -> list[str]:
    """One entry per import cycle, naming every import inside it (file:line)."""
    bad = []
    for comp in find_cycles(pkg):
        members = set(comp)
        links = []
        for m in comp:
            mod = pkg.modules[m]
            for imp in imports_of(pkg, mod):
                if imp.module in members and imp.module != m:
                    links.append(f"{mod.shown}:{imp.line} -> {imp.module}")
        bad.append(f"cycle between {', '.join(comp)}:\n      " + "\n      ".join(sorted(set(links))))
    return bad


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_definitions(mod: Module) -> set[str]:
    """Private names ``mod`` defines on classes or instances: functions and methods, class attributes
    (names bound in a class body) and ``self._x = ...`` assignments."""
    names = set()
    for node in ast.walk(mod.tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            for stmt in node.body:
                targets = []
                if isinstance(stmt, ast.Assign):
                    targets = stmt.targets
                elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
                    targets = [stmt.target]
                elif isinstance(stmt, ast.ClassDef):
                    names.add(stmt.name)
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            names.add(n.id)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            names.add(node.attr)
    return {n for n in names if _private(n)}


def _module_bindings(pkg: Package, mod: Module) -> dict[str, str]:
    """Names in ``mod`` bound to package modules by its imports (``import a.b`` binds ``a``)."""
    bound = {}
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not _is_package(pkg, alias.name):
                    continue
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(mod, node.level, node.module)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in pkg.modules:
                    bound[alias.asname or alias.name] = sub
    return bound


def _module_of(pkg: Package, expr: ast.expr, bound: dict[str, str]) -> str | None:
    """The package module an expression names (``frame``, ``comm_codec.core.frame``), or None."""
    if isinstance(expr, ast.Name):
        return bound.get(expr.id)
    if isinstance(expr, ast.Attribute):
        base = _module_of(pkg, expr.value, bound)
        if base is not None and f"{base}.{expr.attr}" in pkg.modules:
            return f"{base}.{expr.attr}"
    return None


def check_private(pkg: Package) -> list[str]:
    """Every private name imported from, or reached into on, another module of the package."""
    defined = {m: private_definitions(mod) for m, mod in pkg.modules.items()}
    owners: dict[str, set[str]] = {}
    for m, names in defined.items():
        for n in names:
            owners.setdefault(n, set()).add(m)
    bad = []
    for mod in pkg.modules.values():
        for imp in imports_of(pkg, mod):
            if imp.name is not None and _private(imp.name) and _is_package(pkg, imp.target):
                bad.append(
                    f"{mod.shown}:{imp.line}: from {imp.target} import {imp.name} (a private name of another module)"
                )
        bound = _module_bindings(pkg, mod)
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Attribute):
                obj, attr = node.value, node.attr
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                obj, attr = node.args[0], node.args[1].value
            else:
                continue
            if not _private(attr):
                continue
            where = f"{mod.shown}:{node.lineno}"
            target = _module_of(pkg, obj, bound)
            if target is not None:
                if target != mod.name:
                    bad.append(f"{where}: {ast.unparse(obj)}.{attr} reaches into {target}")
                continue
            if isinstance(obj, ast.Name) and obj.id in ("self", "cls"):
                continue
            if attr in NAMEDTUPLE_API or attr in defined[mod.name]:
                continue
            others = sorted(owners.get(attr, set()) - {mod.name})
            if others:
                bad.append(f"{where}: {ast.unparse(obj)}.{attr} uses a private member defined in {', '.join(others)}")
    return bad


def check_sizes(pkg: Package, max_lines: int = MAX_LINES) -> list[str]:
    """Every module longer than ``max_lines`` lines."""
    return [
        f"{mod.shown}: {mod.nlines} lines (at most {max_lines})"
        for mod in pkg.modules.values()
        if mod.nlines > max_lines
    ]


# -- the real package ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def package() -> Package:
    return load_package(REPO / PACKAGE, shown_from=REPO)


def _sort_key(entry: str):
    path, _, rest = entry.partition(":")
    line = rest.partition(":")[0]
    return path, int(line) if line.isdigit() else 0, entry


def _fail_listing(title: str, bad: list[str]) -> None:
    if bad:
        pytest.fail(f"{len(bad)} {title}:\n  " + "\n  ".join(sorted(bad, key=_sort_key)), pytrace=False)


@pytest.mark.slow
def test_the_checker_sees_every_layer(package):
    layers = {layer_of(package, m) for m in package.modules}
    assert {
        "kernels",
        "core",
        "books",
        "comm",
        "checkpoint",
        "integrations",
        "tools",
        "root",
        "facade",
        "main",
    } <= layers, layers
    assert sum(len(imports_of(package, mod)) for mod in package.modules.values()) > 100


def test_layers_import_only_layers_below_them(package):
    bad = check_layers(package)
    _fail_listing("imports break the layer order", bad)


def test_no_import_cycle(package):
    bad = check_cycles(package)
    _fail_listing("import cycles", bad)


def test_no_private_name_crosses_modules(package):
    bad = check_private(package)
    _fail_listing("private names used across modules", bad)


def test_no_module_is_too_long(package):
    bad = check_sizes(package)
    _fail_listing("modules too long", bad)


# -- the checker itself, on synthetic packages ------------------------------------------------
def make_package(tmp_path: Path, files: dict[str, str]) -> Package:
    """Write a mini ``comm_codec`` (path -> source; missing ``__init__.py`` files added) and load it."""
    root = tmp_path / PACKAGE
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for d in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        (d / "__init__.py").touch()
    return load_package(root)


CLEAN = {
    "__init__.py": "from .core.errors import FrameError\nfrom .core.version import __version__\n",
    "__main__.py": "from .tools.cli import main\n",
    "ddp.py": "from .comm.ddp import *\n",
    "kernels/cpu.py": "import numpy as np\nimport numba\nimport os\n\ndef _kernel(x):\n    return x\n\n"
    "def encode(x):\n    return _kernel(x)\n",
    "core/errors.py": "class FrameError(ValueError):\n    pass\n",
    "core/version.py": "__version__ = '0.1.0'\n",
    "core/frame.py": "import torch\nfrom ..kernels import cpu\nfrom .errors import FrameError\n\n"
    "class Frame:\n    _cache = None\n\n    def __init__(self):\n        self._n = 0\n\n"
    "    def _grow(self):\n        self._n += 1\n        return self.__class__, cpu.encode(1)\n",
    "books/profiler.py": "import torch\nfrom ..core.frame import Frame\n",
    "comm/engine.py": "import torch.distributed as dist\nfrom ..books import profiler\nfrom ..core import frame\n\n"
    "def step(f):\n    from ..kernels.cpu import encode\n    return f.__dict__, frame.Frame\n",
    "comm/ddp.py": "from .engine import step\n__all__ = ['step']\n",
    "checkpoint/files.py": "import zlib\nfrom ..core.frame import Frame\nfrom collections import namedtuple\n\n"
    "def f(t):\n    return t._replace(a=1), t._asdict()\n",
    "integrations/hf.py": "from ..comm.ddp import step\n",
    "tools/cli.py": "import importlib\nfrom ..checkpoint import files\nfrom ..comm import engine\n\n"
    "def main():\n    return importlib.import_module('comm_codec.integrations.hf')\n",
}


def test_checker_passes_a_clean_package(tmp_path):
    pkg = make_package(tmp_path, CLEAN)
    assert check_layers(pkg) == [] and check_cycles(pkg) == [] and check_private(pkg) == [] and check_sizes(pkg) == []
    assert layer_of(pkg, "comm_codec.ddp") == "facade" and layer_of(pkg, "comm_codec.comm.ddp") == "comm"
    # edges: a function-level import, `from pkg import module`, a literal import_module
    edges = {i.module for i in imports_of(pkg, pkg.modules["comm_codec.comm.engine"])}
    assert {"comm_codec.kernels.cpu", "comm_codec.core.frame", "comm_codec.books.profiler"} <= edges
    edges = {i.module for i in imports_of(pkg, pkg.modules["comm_codec.tools.cli"])}
    assert "comm_codec.integrations.hf" in edges


def test_relative_imports_resolve_in_packages_and_modules(tmp_path):
    pkg = make_package(
        tmp_path,
        {
            **CLEAN,
            "core/__init__.py": "from .frame import Frame\nfrom .. import kernels\n",
            "core/sub/deep.py": "from ...kernels.cpu import encode\nfrom .. import frame\n",
        },
    )
    assert {i.module for i in imports_of(pkg, pkg.modules["comm_codec.core"])} == {
        "comm_codec.core.frame",
        "comm_codec.kernels",
    }
    assert {i.module for i in imports_of(pkg, pkg.modules["comm_codec.core.sub.deep"])} == {
        "comm_codec.kernels.cpu",
        "comm_codec.core.frame",
    }


def test_checker_finds_a_two_module_cycle(tmp_path):
    pkg = make_package(
        tmp_path, {**CLEAN, "core/a.py": "from . import b\n", "core/b.py": "def f():\n    from .a import thing\n"}
    )
    assert find_cycles(pkg) == [["comm_codec.core.a", "comm_codec.core.b"]]
    (msg,) = check_cycles(pkg)
    assert "core/a.py:1 -> comm_codec.core.b" in msg and "core/b.py:2 -> comm_codec.core.a" in msg


def test_checker_finds_a_longer_cycle_through_import_statements(tmp_path):
    pkg = make_package(
        tmp_path,
        {
            **CLEAN,
            "comm/a.py": "import comm_codec.comm.b\n",
            "comm/b.py": "from comm_codec.comm import c\n",
            "comm/c.py": "from .a import x\n",
        },
    )
    assert find_cycles(pkg) == [["comm_codec.comm.a", "comm_codec.comm.b", "comm_codec.comm.c"]]


def test_checker_finds_a_function_level_upward_import(tmp_path):
    pkg = make_package(
        tmp_path, {**CLEAN, "core/codec.py": "def f():\n    if True:\n        from ..comm.engine import step\n"}
    )
    assert check_layers(pkg) == [
        "comm_codec/core/codec.py:3: core imports from comm_codec.comm.engine import step (comm layer; "
        "core may import kernels)"
    ]


@pytest.mark.parametrize(
    "where, source, expected",
    [
        (
            "checkpoint/x.py",
            "from ..comm import engine\n",
            "checkpoint imports from comm_codec.comm import engine (comm layer",
        ),
        ("checkpoint/x.py", "import torch.distributed as dist\n", "never uses torch.distributed"),
        ("checkpoint/x.py", "from torch.distributed import checkpoint\n", "never uses torch.distributed"),
        ("books/x.py", "from torch import distributed\n", "never uses torch.distributed"),
        ("kernels/x.py", "import torch\n", "kernels imports torch (a kernels module may import only"),
        ("kernels/x.py", "from ..core.frame import Frame\n", "kernels imports from comm_codec.core.frame import Frame"),
        (
            "core/errors.py",
            "from ..kernels import cpu\n",
            "comm_codec.core.errors imports from comm_codec.kernels import cpu",
        ),
        (
            "core/version.py",
            "from . import errors\n",
            "comm_codec.core.version imports from comm_codec.core import errors",
        ),
        ("comm/x.py", "from ..integrations.hf import y\n", "comm imports from comm_codec.integrations.hf import y"),
        ("comm/x.py", "from ..checkpoint import files\n", "comm imports from comm_codec.checkpoint import files"),
        (
            "integrations/x.py",
            "from ..tools.cli import main\n",
            "integrations imports from comm_codec.tools.cli import main",
        ),
        ("checkpoint/x.py", "def f():\n    from ..tools.cli import main\n", "nothing outside tools imports tools"),
        (
            "comm/x.py",
            "import importlib\nimportlib.import_module('comm_codec.tools.cli')\n",
            "nothing outside tools imports tools",
        ),
        (
            "core/x.py",
            "import importlib\nimportlib.import_module('..comm.engine', __package__)\n",
            "core imports comm_codec.comm.engine (comm layer",
        ),
        (
            "__init__.py",
            "from .core.codec import Codec\n",
            "the package root imports from comm_codec.core.codec import Codec eagerly",
        ),
        ("fsdp.py", "from .core.frame import Frame\n", "facade imports from comm_codec.core.frame import Frame"),
        ("core/x.py", "import comm_codec as cc\n", "imports the package root (comm_codec)"),
        ("core/x.py", "from comm_codec import Codec\n", "imports the package root (from comm_codec import Codec)"),
        (
            "tools/x.py",
            "def f():\n    from .. import Codec\n",
            "imports the package root (from comm_codec import Codec)",
        ),
        ("stray.py", "x = 1\n", "module comm_codec.stray is in no layer"),
    ],
)
def test_checker_finds_layer_breaks(tmp_path, where, source, expected):
    pkg = make_package(tmp_path, {**CLEAN, where: source})
    bad = check_layers(pkg)
    assert len(bad) == 1 and expected in bad[0], bad
    assert bad[0].startswith(f"comm_codec/{where}:")


def test_checker_does_not_guess_an_anchor_it_cannot_read(tmp_path):
    source = "import importlib\nimportlib.import_module('.comm', __name__.rpartition('.')[0])\n"
    pkg = make_package(tmp_path, {**CLEAN, "core/x.py": source})
    assert imports_of(pkg, pkg.modules["comm_codec.core.x"])[1:] == [] and check_layers(pkg) == []


def test_checker_lists_every_offender(tmp_path):
    pkg = make_package(
        tmp_path, {**CLEAN, "kernels/x.py": "import torch\nimport scipy\n", "core/x.py": "from ..comm import engine\n"}
    )
    assert len(check_layers(pkg)) == 3


def test_checker_allows_submodule_imports_that_are_not_the_root(tmp_path):
    pkg = make_package(
        tmp_path, {**CLEAN, "tools/x.py": "from .. import checkpoint, comm\nimport comm_codec.comm.ddp\n"}
    )
    assert check_layers(pkg) == []


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from ..core.frame import _thing\n", "from comm_codec.core.frame import _thing"),
        ("def f():\n    from ..core import _helpers\n", "from comm_codec.core import _helpers"),
        ("from ..core import frame\nx = frame._anything\n", "frame._anything reaches into comm_codec.core.frame"),
        ("import comm_codec.core.frame as fr\nx = fr._y\n", "fr._y reaches into comm_codec.core.frame"),
        (
            "import comm_codec.core.frame\nx = comm_codec.core.frame._y\n",
            "comm_codec.core.frame._y reaches into comm_codec.core.frame",
        ),
        (
            "def f(state):\n    return state.frame._grow()\n",
            "state.frame._grow uses a private member defined in comm_codec.core.frame",
        ),
        ("def f(s):\n    s._n = 3\n", "s._n uses a private member defined in comm_codec.core.frame"),
        (
            "def f(s):\n    return getattr(s, '_cache')\n",
            "s._cache uses a private member defined in comm_codec.core.frame",
        ),
        ("class B:\n    def f(self):\n        return super()._grow()\n", "super()._grow uses a private member"),
    ],
)
def test_checker_finds_private_names_across_modules(tmp_path, source, expected):
    pkg = make_package(tmp_path, {**CLEAN, "comm/x.py": source})
    bad = check_private(pkg)
    assert len(bad) == 1 and expected in bad[0], bad
    assert bad[0].startswith("comm_codec/comm/x.py:")


@pytest.mark.parametrize(
    "source",
    [
        "class A:\n    def __init__(self):\n        self._n = 1\n\n    def f(self, other):\n        return other._n\n",
        "def f(x):\n    return x.__class__, x.__dict__\n",
        "def f(t):\n    return t._replace(), t._fields\n",
        "class A:\n    def f(self):\n        return self._grow(), type(self).__name__\n",
        "import torch\nx = torch._C\n",
    ],
)
def test_checker_allows_own_and_dunder_and_outside_names(tmp_path, source):
    pkg = make_package(tmp_path, {**CLEAN, "comm/x.py": source})
    assert check_private(pkg) == []


def test_checker_finds_long_files(tmp_path):
    pkg = make_package(
        tmp_path, {**CLEAN, "core/big.py": "x = 1\n" * (MAX_LINES + 1), "core/ok.py": "x = 1\n" * MAX_LINES}
    )
    assert check_sizes(pkg) == [f"comm_codec/core/big.py: {MAX_LINES + 1} lines (at most {MAX_LINES})"]
