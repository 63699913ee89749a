"""The layout holds: imports run only down the rooms common/__init__.py lists, files and
lines stay short enough to read in one sitting, launch/ holds few modules flat, and
docs/tests.md names every test file."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PROCESSES = {
    "common",
    "common.base",
    "common.kv",
    "common.wire",
    "common.engine",
    "common.transfer",
    "common.handoff",
    "common.runtime",
    "kernels",
    "frontend",
    "prefill_node",
    "decode_node",
}
# room -> the rooms it may import (besides itself); a room is the longest matching prefix.
ALLOWED = {
    "common.base": set(),
    "kernels": set(),
    "common.kv": {"common.base"},
    "common.wire": {"common.base"},
    "common.engine": {"common.base", "common.kv", "kernels"},
    "common.transfer": {"common.base", "common.kv", "common.wire", "common.engine", "kernels"},
    "common.handoff": {"common.base", "common.kv", "common.wire", "common.transfer"},
    "common.runtime": {"common.base", "common.wire"},
    "frontend": {"common.base", "common.kv", "common.wire", "common.runtime"},
    "prefill_node": {
        "common",
        "common.base",
        "common.kv",
        "common.wire",
        "common.engine",
        "common.transfer",
        "common.handoff",
        "common.runtime",
        "kernels",
    },
    "decode_node": {
        "common",
        "common.base",
        "common.kv",
        "common.wire",
        "common.engine",
        "common.transfer",
        "common.handoff",
        "common.runtime",
        "kernels",
    },
    "launch.cluster": _PROCESSES,  # one host's cluster: its plan, checks and supervisor
    "launch.ray": {*_PROCESSES, "launch.cluster"},  # the cluster on Ray
    "launch.tools": {*_PROCESSES, "launch.cluster"},  # what the tests share with operators
    "launch.bench": {*_PROCESSES, "launch.cluster", "launch.tools"},  # the benchmarks
    # The entry points (the CLI, the launcher, keys, a tiny model, offline generation), over
    # everything and under nothing: no process imports them; the CLI reaches launch.bench
    # by name only.
    "launch": {*_PROCESSES, "launch.cluster", "launch.ray", "launch.tools"},
}
OURS = ("common", "kernels", "frontend", "prefill_node", "decode_node", "launch")


def _room(module: str) -> str | None:
    matches = [r for r in ALLOWED if module == r or module.startswith(r + ".")]
    return max(matches, key=len) if matches else ("common" if module == "common" else None)


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import of ours in the file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from common import transfer` imports common.transfer
            out += [
                (node.lineno, f"{node.module}.{a.name}")
                if node.module in ("common", "kernels")
                else (node.lineno, node.module)
                for a in node.names
            ]
    return sorted((line, m) for line, m in out if m.split(".")[0] in OURS)


def _sources() -> list[Path]:
    return sorted(
        p for top in ALLOWED if "." not in top for p in (ROOT / top.replace(".", "/")).rglob("*.py")
    ) + sorted((ROOT / "common").rglob("*.py"))


def test_imports_run_only_down_the_rooms():
    upward = []
    for path in _sources():
        here = _room(_module_of(path))
        if here is None or here == "common":
            continue
        for line, module in _imports(path):
            there = _room(module)
            if there is None:
                upward.append(
                    f"{path.relative_to(ROOT)}:{line} imports {module} (outside every room)"
                )
            elif there != here and there not in ALLOWED[here]:
                upward.append(
                    f"{path.relative_to(ROOT)}:{line} ({here}) imports {module} ({there})"
                )
    assert not upward, "imports against the rooms' order:\n" + "\n".join(upward)


def test_the_checker_sees_an_upward_import(tmp_path):
    """The rule itself can fail: an engine module importing the wire is caught."""
    assert _room("common.engine.worker") == "common.engine"
    assert "common.wire" not in ALLOWED[_room("common.engine.worker")]
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from common.wire.channel import Channel\nimport kernels\n")
    assert _imports(bad) == [(2, "common.wire.channel"), (3, "kernels")]


def test_every_room_says_what_it_may_import():
    for room in ALLOWED:
        if not room.startswith("common."):
            continue
        doc = importlib.import_module(room).__doc__ or ""
        assert "import" in doc.lower(), f"{room}/__init__.py does not say what it may import"


def _module_file(module: str) -> Path | None:
    base = ROOT / module.replace(".", "/")
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def _graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports, at any depth (inside functions and under
    TYPE_CHECKING too: a cycle hidden there is still a cycle for a reader)."""
    graph = {}
    for top in OURS:
        for path in sorted((ROOT / top).rglob("*.py")):
            here = _module_of(path)
            graph[here] = set()
            for _, module in _imports(path):
                # `from a.b import c`: the module a.b.c if there is one, else a.b
                target = module if _module_file(module) else module.rsplit(".", 1)[0]
                while target and not _module_file(target):
                    target = target.rpartition(".")[0]
                if target and target != here:
                    graph[here].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_not_even_lazy_ones():
    cycles = _cycles(_graph())
    assert not cycles, "modules that import each other:\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_the_cycle_finder_sees_a_lazy_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_kernels_import_nothing_of_pdserve():
    """Device ops take what they need as arguments: kernels/ is a leaf under the engine."""
    bad = [
        f"{p.relative_to(ROOT)}:{line} imports {m}"
        for p in sorted((ROOT / "kernels").rglob("*.py"))
        for line, m in _imports(p)
        if m.split(".")[0] != "kernels"
    ]
    assert not bad, bad


MAX_LINES = 410  # a file read in one sitting; tests are exempt


def test_no_source_file_is_too_long_to_read_in_one_sitting():
    long = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for top in (*OURS,)
        for p in sorted((ROOT / top).rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, f"over {MAX_LINES} lines:\n" + "\n".join(long)


MAX_LAUNCH_MODULES = 8  # launch/'s flat modules: more go into a package of their own
MAX_LINE_LEN = 100  # ruff's line-length (pyproject.toml)
MAX_LONG_LINE_SHARE = 0.01  # lines ruff cannot wrap (long strings, URLs): a few, not a habit


def test_launch_holds_few_modules_flat():
    flat = sorted(p.name for p in (ROOT / "launch").glob("*.py") if p.name != "__init__.py")
    assert len(flat) <= MAX_LAUNCH_MODULES, (
        f"launch/ holds {len(flat)} modules flat, over {MAX_LAUNCH_MODULES}: {flat}"
    )


def test_few_source_lines_are_longer_than_ruff_wraps():
    """A line cap the formatter cannot meet is met by few lines, not by many."""
    lines = [
        (p, line)
        for top in OURS
        for p in sorted((ROOT / top).rglob("*.py"))
        for line in p.read_text().splitlines()
    ]
    long = [f"{p.relative_to(ROOT)}: {len(line)}" for p, line in lines if len(line) > MAX_LINE_LEN]
    share = len(long) / len(lines)
    assert share <= MAX_LONG_LINE_SHARE, (
        f"{len(long)} of {len(lines)} lines ({share:.1%}) are over {MAX_LINE_LEN} columns:\n"
        + "\n".join(long)
    )


ROOMS = ("unit", "cluster")


def test_docs_tests_md_names_every_test_file_and_no_other():
    """docs/tests.md's table says which files to run for a change: it lists every test file
    of both rooms, and only files that exist."""
    text = (ROOT / "docs" / "tests.md").read_text()
    below = text[text.index("## Changed this room") :].splitlines()
    start = next(i for i, line in enumerate(below) if line.startswith("|"))
    end = next((i for i in range(start, len(below)) if not below[i].startswith("|")), len(below))
    named = set(re.findall(r"`(test_\w+)`", "\n".join(below[start:end])))
    files = {p.stem for room in ROOMS for p in (ROOT / "tests" / room).glob("test_*.py")}
    assert not files - named, f"docs/tests.md's table leaves out {sorted(files - named)}"
    assert not named - files, f"docs/tests.md's table names no such file: {sorted(named - files)}"
