"""The runtime's shape, measured from its code: modules per folder, the longest classes and
modules, import cycles (imports inside functions included) and the layers' contract.

    python hack/structure.py [--package jaxps_runtime] [--root runtime] [--json]
    python hack/structure.py --check      # make verify: no class over 300 lines

Imports are read by grimp (import-linter's graph): every import statement, at module level,
inside functions or under TYPE_CHECKING. A cycle is a strongly connected set of modules (two
or more modules that reach each other); "imports in cycles" counts the imports between the
modules of one such set, the ones that point back up whichever way the set is cut.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import grimp

MAX_CLASS_LINES = 300


def _modules(root: Path, package: str) -> dict[str, Path]:
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def _classes(modules: dict[str, Path]) -> list[tuple[int, str]]:
    found = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                found.append((node.end_lineno - node.lineno + 1, f"{name}.{node.name}"))
    return sorted(found, reverse=True)


def _cycles(graph: grimp.ImportGraph, names: set[str]) -> list[list[str]]:
    """Strongly connected sets of two or more modules (Tarjan's algorithm)."""
    edges = {m: sorted(graph.find_modules_directly_imported_by(m) & names) for m in names}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(start: str) -> None:  # iterative, so deep graphs do not hit the recursion limit
        nonlocal counter
        work = [(start, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on.add(node)
            recurse = False
            for j in range(i, len(edges[node])):
                nxt = edges[node][j]
                if nxt not in index:
                    work.append((node, j + 1))
                    work.append((nxt, 0))
                    recurse = True
                    break
                if nxt in on:
                    low[node] = min(low[node], index[nxt])
            if recurse:
                continue
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    out.append(sorted(group))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])

    for name in sorted(names):
        if name not in index:
            visit(name)
    return sorted(out)


def measure(root: Path, package: str) -> dict[str, Any]:
    sys.path.insert(0, str(root))
    modules = _modules(root, package)
    graph = grimp.build_graph(package, cache_dir=None)
    names = set(modules)
    cycles = _cycles(graph, names)
    in_cycles = sum(
        len(graph.find_modules_directly_imported_by(m) & set(group))
        for group in cycles
        for m in group
    )
    folders = Counter(str(p.parent.relative_to(root)) for p in modules.values())
    sizes = sorted(((_lines(p), n) for n, p in modules.items()), reverse=True)
    classes = _classes(modules)
    return {
        "modules": len(modules),
        "folders": dict(sorted(folders.items())),
        "largest modules": [f"{n} {lines}" for lines, n in sizes[:8]],
        "largest classes": [f"{n} {lines}" for lines, n in classes[:8]],
        f"classes over {MAX_CLASS_LINES} lines": [
            f"{n} {lines}" for lines, n in classes if lines > MAX_CLASS_LINES
        ],
        "cycles": [" <-> ".join(group) for group in cycles],
        "imports in cycles": in_cycles,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--root", type=Path, default=Path(__file__).resolve().parents[1] / "runtime"
    )
    parser.add_argument("--package", default="jaxps_runtime")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    parser.add_argument(
        "--check", action="store_true", help=f"fail on a class over {MAX_CLASS_LINES} lines"
    )
    args = parser.parse_args(argv)
    shape = measure(args.root.resolve(), args.package)
    if args.check:
        over = shape[f"classes over {MAX_CLASS_LINES} lines"]
        if over:
            print(f"classes over {MAX_CLASS_LINES} lines (split them): {', '.join(over)}")
            return 1
        print(f"no class of {args.package} over {MAX_CLASS_LINES} lines")
        return 0
    if args.json:
        print(json.dumps(shape))
        return 0
    for key, value in shape.items():
        text = str(value)
        if isinstance(value, dict):
            text = ", ".join(f"{k}: {v}" for k, v in value.items())
        elif isinstance(value, list):
            text = "; ".join(value) or "none"
        print(f"{key}: {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
