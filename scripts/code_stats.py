"""The shape of the code: top-level modules of jaxllm/, function lengths, the import graph.

Usage: python scripts/code_stats.py [--root PATH] [--json]

Reads the sources with ``ast`` only (nothing is imported, JAX included), so it runs on any
checkout: ``--root`` names one (default: the repository holding this script), e.g. an older
commit's worktree for before/after figures. tests/test_layout.py asserts on the same functions.

What is counted:
  top level   ``*.py`` files and package folders (holding ``__init__.py``) directly under
              jaxllm/, ``__init__.py`` itself not counted.
  a function  each ``def`` / ``async def``, nested ones on their own too; its lines are
              ``end_lineno - lineno + 1`` of the def: decorators excluded, docstring included.
  imports     static imports of each module, also those inside functions (they run when
              called); not those under ``if TYPE_CHECKING:``, which never run.
  docstrings  lines of module, class and function docstrings over all lines of the ``*.py`` files
              under jaxllm/, scheduler/ and kernels_pallas/.
  house       README.md lines, ``ModelRunner``'s methods and lines, scheduler/scheduler.py lines, the source
              files (``*.py``, ``*.cc``, ``*.h`` of the three packages) that mention "compress", and the modules
              that import the C++ driver ``kernels_pallas.cpu_build``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import json
import statistics
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxllm", "scheduler")
SOURCE_PACKAGES = ("jaxllm", "scheduler", "kernels_pallas")
NATIVE_DRIVER = "kernels_pallas.cpu_build"
LONG_FUNCTION = 100
# The functions the reviews track, by qualified name and the package that holds them.
TRACKED = (("jaxllm", "EngineCore.step"), ("scheduler", "Scheduler.schedule"))


@dataclasses.dataclass(frozen=True)
class Function:
    """One def: its qualified name (``Class.method``, ``outer.<locals>.inner``), file, first line and length."""

    qualname: str
    path: str
    lineno: int
    lines: int


@functools.lru_cache
def _modules(root: Path, package: str) -> dict[str, tuple[str, ast.Module]]:
    """Dotted module name -> (path from ``root``, parsed source), for every ``*.py`` under ``root/package``."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        relative = path.relative_to(root)
        name = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
        modules[name] = relative.as_posix(), ast.parse(path.read_text(), filename=str(path))
    return modules


def top_level(root: Path) -> dict[str, list[str]]:
    """The ``*.py`` modules (``__init__.py`` excluded) and package folders directly under ``root/jaxllm``."""
    entries = sorted((root / "jaxllm").iterdir())
    return {
        "modules": [p.name for p in entries if p.suffix == ".py" and p.name != "__init__.py"],
        "packages": [p.name for p in entries if p.is_dir() and (p / "__init__.py").exists()],
    }


def functions(root: Path, package: str) -> list[Function]:
    """Every function and method defined under ``root/package``, nested ones included."""
    found = []

    def visit(node: ast.AST, prefix: str, path: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qualname = prefix + child.name
                found.append(Function(qualname, path, child.lineno, child.end_lineno - child.lineno + 1))
                visit(child, f"{qualname}.<locals>.", path)
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.", path)
            else:
                visit(child, prefix, path)

    for path, tree in _modules(root, package).values():
        visit(tree, "", path)
    return found


def walk_runtime(tree: ast.AST) -> Iterator[ast.AST]:
    """``ast.walk`` without the bodies of ``if TYPE_CHECKING:`` blocks."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            yield from (n for child in node.orelse for n in ast.walk(child))
            continue
        yield node
        yield from walk_runtime(node)


def import_graph(root: Path, package: str = "jaxllm", toplevel_only: bool = False,
                 type_checking: bool = False) -> dict[str, set[str]]:
    """Module of ``package`` -> the modules of ``package`` and the top-level packages it imports (statically).

    ``toplevel_only`` keeps the imports of the module's body (what importing it runs), else those inside
    functions count too; ``type_checking`` also counts those under ``if TYPE_CHECKING:``, which never run.
    Edges to other packages name only their top level (``jax``, ``scheduler``).
    """
    modules = _modules(root, package)
    graph: dict[str, set[str]] = {}
    for name, (_, tree) in modules.items():
        targets = set()
        for node in tree.body if toplevel_only else ast.walk(tree) if type_checking else walk_runtime(tree):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        # Importing a.b.c imports the packages a and a.b first; a module's own packages are already
        # imported (or being imported) when it runs, so they are no edge of it.
        parents = {t.rsplit(".", k)[0] for t in targets for k in range(1, t.count(".") + 1)}
        edges = {t for t in targets | parents if t in modules} | {t.split(".")[0] for t in targets}
        graph[name] = {t for t in edges if t != name and not name.startswith(f"{t}.")}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles a depth-first walk of ``graph`` meets, each as ``[a, b, ..., a]``; [] when there is none."""
    cycles, done, path = [], set(), []

    def visit(module: str) -> None:
        if module in path:
            cycles.append(path[path.index(module):] + [module])
            return
        if module in done or module not in graph:
            return
        path.append(module)
        for target in sorted(graph[module]):
            visit(target)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
    return cycles


def longest_import_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest chain of modules of ``graph`` each importing the next (an edge that closes a cycle is skipped)."""
    longest: dict[str, list[str]] = {}

    def visit(module: str, path: set[str]) -> list[str]:
        if module not in longest:
            path.add(module)
            tails = [visit(t, path) for t in sorted(graph[module]) if t in graph and t not in path]
            path.discard(module)
            longest[module] = [module] + max(tails, key=len, default=[])
        return longest[module]

    return max((visit(m, set()) for m in sorted(graph)), key=len, default=[])


def docstring_lines(root: Path) -> dict[str, int]:
    """Docstring lines and all lines of the ``*.py`` files of :data:`SOURCE_PACKAGES` under ``root``."""
    docs = total = 0
    for package in SOURCE_PACKAGES:
        for path, tree in _modules(root, package).values():
            total += len((root / path).read_text().splitlines())
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and \
                        ast.get_docstring(node, clean=False) is not None:
                    docs += node.body[0].end_lineno - node.body[0].lineno + 1
    return {"docstring_lines": docs, "lines": total}


def class_size(root: Path, package: str, name: str) -> dict | None:
    """The methods (direct ``def``s) and lines of the first class named ``name`` under ``root/package``."""
    for path, tree in _modules(root, package).values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == name:
                methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                return {"path": path, "methods": len(methods), "lines": node.end_lineno - node.lineno + 1}
    return None


def house(root: Path) -> dict:
    """The house figures: README lines, ModelRunner's size, scheduler.py lines, compression, the C++ driver."""
    sources = [p for package in SOURCE_PACKAGES for suffix in ("*.py", "*.cc", "*.h")
               for p in sorted((root / package).rglob(suffix))]
    importers = set()
    for package in SOURCE_PACKAGES:
        for module, (_, tree) in _modules(root, package).items():
            for node in ast.walk(tree):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [f"{node.module}.{a.name}" for a in node.names] + [node.module]
                         if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
                if module != NATIVE_DRIVER and NATIVE_DRIVER in names:
                    importers.add(module)
    scheduler_py = root / "scheduler" / "scheduler.py"
    return {
        "readme_lines": len((root / "README.md").read_text().splitlines()),
        "model_runner": class_size(root, "jaxllm", "ModelRunner"),
        "scheduler_py_lines": len(scheduler_py.read_text().splitlines()) if scheduler_py.exists() else None,
        "files_mentioning_compress": sorted(p.relative_to(root).as_posix() for p in sources
                                            if "compress" in p.read_text().lower()),
        "native_driver_importers": sorted(importers),
    }


def _function_stats(found: list[Function]) -> dict:
    longest = max(found, key=lambda f: f.lines)
    return {
        "functions": len(found),
        "median_lines": statistics.median(f.lines for f in found),
        f"over_{LONG_FUNCTION}_lines": sum(f.lines > LONG_FUNCTION for f in found),
        "longest": dataclasses.asdict(longest),
    }


def stats(root: Path) -> dict:
    """All the figures this script prints, as one JSON-able dict."""
    found = {package: functions(root, package) for package in PACKAGES}
    graph = import_graph(root)
    chain = longest_import_chain(graph)
    at_import = longest_import_chain(import_graph(root, toplevel_only=True))
    top = top_level(root)
    return {
        "root": str(root),
        "top_level": {**top, "count": len(top["modules"]) + len(top["packages"])},
        "function_lines": {package: _function_stats(found[package]) for package in PACKAGES},
        "tracked": {name: next((dataclasses.asdict(f) for f in found[package] if f.qualname == name), None)
                    for package, name in TRACKED},
        "docstrings": docstring_lines(root),
        "house": house(root),
        "imports": {
            "modules": len(graph),
            "longest_chain_depth": len(chain),
            "longest_chain": chain,
            "longest_chain_at_import_depth": len(at_import),
            "longest_chain_at_import": at_import,
            "cycles": import_cycles(graph),
            "cycles_with_type_checking": import_cycles(import_graph(root, type_checking=True)),
        },
    }


def _cycles(cycles: list[list[str]]) -> str:
    return "; ".join(" -> ".join(c) for c in cycles) or "none"


def report(s: dict) -> str:
    """``stats`` as the lines this script prints."""
    top = s["top_level"]
    lines = [
        f"jaxllm code stats, {s['root']}",
        f"jaxllm/ top level: {top['count']} ({len(top['modules'])} modules, {len(top['packages'])} packages; "
        "__init__.py not counted)",
        f"  modules:  {' '.join(top['modules'])}",
        f"  packages: {' '.join(top['packages'])}",
        "function lines: end_lineno - lineno + 1 of each def (decorators excluded, docstring included; "
        "nested defs also on their own)",
    ]
    for package, f in s["function_lines"].items():
        longest = f["longest"]
        lines.append(f"  {package + '/':<11} {f['functions']} functions, median {f['median_lines']:g} lines, "
                     f"{f[f'over_{LONG_FUNCTION}_lines']} over {LONG_FUNCTION}; longest {longest['qualname']} "
                     f"({longest['path']}:{longest['lineno']}, {longest['lines']} lines)")
    for name, f in s["tracked"].items():
        lines.append(f"  {name}: " + (f"{f['lines']} lines ({f['path']}:{f['lineno']})" if f else "not found"))
    imports = s["imports"]
    lines += [
        f"jaxllm imports among its {imports['modules']} modules (a chain's depth counts its modules):",
        f"  longest chain, imports inside functions too: {imports['longest_chain_depth']}: "
        + " -> ".join(imports["longest_chain"]),
        f"  longest chain, module bodies only (what `import` runs): {imports['longest_chain_at_import_depth']}: "
        + " -> ".join(imports["longest_chain_at_import"]),
        f"  cycles: {_cycles(imports['cycles'])}; also counting `if TYPE_CHECKING:` imports: "
        f"{_cycles(imports['cycles_with_type_checking'])}",
    ]
    docs, h = s["docstrings"], s["house"]
    runner = h["model_runner"]
    lines += [
        f"docstrings: {docs['docstring_lines']} of {docs['lines']} lines "
        f"({docs['docstring_lines'] / docs['lines']:.1%}) in {', '.join(SOURCE_PACKAGES)}",
        f"README.md: {h['readme_lines']} lines; scheduler/scheduler.py: {h['scheduler_py_lines']} lines",
        "ModelRunner: " + (f"{runner['methods']} methods, {runner['lines']} lines ({runner['path']})" if runner
                           else "not found"),
        f"files mentioning compression: {len(h['files_mentioning_compress'])}: "
        + " ".join(h["files_mentioning_compress"]),
        f"modules importing {NATIVE_DRIVER}: {len(h['native_driver_importers'])}: "
        + " ".join(h["native_driver_importers"]),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Print the figures of ``--root`` (default: this repository), as text or ``--json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=REPO, help="the checkout to measure (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    s = stats(args.root.resolve())
    print(json.dumps(s, indent=2) if args.json else report(s))


if __name__ == "__main__":
    main()
