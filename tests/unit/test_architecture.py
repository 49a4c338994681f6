"""The layer rule of docs/architecture.md holds for every import under src/.

The page's layer table says which package sits on which floor; a module may import its
own package and lower floors only, and no two modules may import each other in a circle
(lazy imports inside functions and TYPE_CHECKING imports count: they are real edges).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "slipstream"
# Generated protobuf code is not ours to layer.
SKIP = ("protocol/proto/",)


def layers() -> dict[str, int]:
    """Package (or ground-floor module) -> layer, from the page's table."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("<!-- layers:", 1)[1]
    result = {}
    for line in table.splitlines()[1:]:
        row = re.match(r"\|\s*(\d+)\s*\|([^|]*)\|", line)
        if row is None:
            if result and not line.startswith("|"):
                break
            continue
        for name in re.findall(r"`([a-z_]+)`", row.group(2)):
            result[name] = int(row.group(1))
    return result


def modules() -> dict[str, Path]:
    found = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith(SKIP):
            continue
        parts = ["slipstream", *path.relative_to(SRC).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(path: Path, module: str) -> Iterator[str]:
    """Every slipstream module ``module`` imports (absolute names)."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("slipstream"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if not base.startswith("slipstream"):
                continue
            for alias in node.names:
                # `from slipstream.x import y`: y is a module when such a module exists.
                yield f"{base}.{alias.name}"
                yield base


def graph() -> dict[str, set[str]]:
    known = modules()
    edges: dict[str, set[str]] = {}
    for module, path in known.items():
        edges[module] = {name for name in imports(path, module) if name in known} - {module}
    return edges


def floor(module: str) -> str:
    """The layer-table name of a module: its package, or itself on the ground floor."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_package_has_a_layer() -> None:
    table = layers()
    missing = sorted({floor(m) for m in modules()} - set(table) - {"__init__"})
    assert not missing, f"add {missing} to the layer table of docs/architecture.md"


def test_no_import_runs_up_or_sideways() -> None:
    table = layers()
    wrong = []
    for module, targets in graph().items():
        here = floor(module)
        for target in targets:
            there = floor(target)
            if there in (here, "__init__"):
                continue
            if table[there] >= table[here]:
                wrong.append(
                    f"{module} (layer {table[here]}) imports {target} (layer {table[there]})"
                )
    assert not wrong, "imports against docs/architecture.md:\n" + "\n".join(sorted(wrong))


def test_no_import_circles_between_modules() -> None:
    edges = graph()
    circles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                circles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_check_sees_a_violation() -> None:
    # The parser and the graph are what the two tests above trust: a known edge of the
    # tree must be found, with the layers the page gives.
    table = layers()
    assert table["errors"] == 0 and table["server"] > table["serving"] > table["scheduling"]
    assert "slipstream.serving.core" in graph()["slipstream.server.runner"]


def test_bench_modes_share_only_the_core() -> None:
    # bench/ is one measurement core under two modes: a mode imports the core, never the
    # other mode, and the core imports neither (docs/architecture.md, "bench").
    rooms = ("core", "v2", "openai")
    wrong = []
    for module, targets in graph().items():
        parts = module.split(".")
        if parts[:2] != ["slipstream", "bench"] or len(parts) < 4 or parts[2] not in rooms:
            continue
        for target in targets:
            there = target.split(".")
            in_bench = there[:2] == ["slipstream", "bench"] and len(there) > 3
            if in_bench and there[2] not in (parts[2], "core"):
                wrong.append(f"{module} imports {target}")
    assert not wrong, "bench modes must meet only in bench/core:\n" + "\n".join(sorted(wrong))
