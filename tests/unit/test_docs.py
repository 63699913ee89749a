"""The README is a page a newcomer reads first, the rest is in docs/, and what they say
holds: links resolve, Python snippets compile, every command names something that
exists, docs/configuration.md is what the flags say, and every subcommand helps every
flag (what the pages run, run: tests/cluster/test_docs_run.py)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from launch import docs
from launch.cli import BENCHMARKS, COMMANDS

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
OURS = ("launch", "frontend", "prefill_node", "decode_node", "common", "tests")
MAX_README_LINES = 250


def _code(text: str) -> list[str]:
    """Fenced blocks and inline code spans."""
    fenced = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    rest = re.sub(r"```.*?```", "", text, flags=re.S)
    return fenced + re.findall(r"`([^`\n]+)`", rest)


def _modules() -> set[str]:
    return {
        m
        for page in PAGES
        for code in _code(page.read_text())
        for m in re.findall(r"python3? -m ([a-z_.]+)", code)
        if m.split(".")[0] in OURS
    }


def test_the_readme_opens_with_the_two_commands_and_is_one_sitting():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    first = _code(text)[0]
    assert "bash launch/start_cluster.sh --demo" in first and "bash launch/run_tests.sh" in first


def test_every_link_resolves():
    broken = [
        f"{page.name}: {link}"
        for page in PAGES
        for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text())
        if not link.startswith("http") and not (page.parent / link).exists()
    ]
    assert not broken, broken


def test_every_snippet_compiles_and_every_command_names_what_exists():
    bad = []
    for page in PAGES:
        text = page.read_text()
        for block in re.findall(r"```python\n(.*?)```", text, re.S):
            compile(block, page.name, "exec")
        for code in _code(text):
            if page == ROOT / "README.md":  # the newcomer's commands run as written, in .venv
                bad += [
                    f"{page.name}: bare python: {line}"
                    for line in code.splitlines()
                    if re.match(r"\s*python3? ", line)
                ]
            bad += [
                f"{page.name}: pdserve {c}"
                for c in re.findall(r"(?:^|[\s/])pdserve ([a-z][a-z-]*)", code)
                if c not in COMMANDS
            ]
            bad += [
                f"{page.name}: {s}"
                for s in re.findall(r"bash (launch/[\w.]+)", code)
                if not (ROOT / s).is_file()
            ]
            bad += [
                f"{page.name}: pdserve bench {k}"
                for k in re.findall(r"pdserve bench ([a-z][a-z-]*)", code)
                if k not in BENCHMARKS
            ]
    bad += [f"no module {m}" for m in _modules() if importlib.util.find_spec(m) is None]
    assert not bad, bad


def test_the_configuration_page_is_what_the_flags_say():
    assert docs.PAGE.read_text() == docs.page(), "run: python -m launch.docs"
    assert "`--max-num-seqs`" in docs.generated()  # vLLM's names are there too


def _parsers() -> dict[str, object]:
    """Every `pdserve` subcommand's parser (bench: each kind), as its main builds it."""
    import argparse
    from unittest import mock

    from launch import cli

    class Built(Exception):
        pass

    def stop(self, *_a, **_k):
        raise Built(self)

    found = {}
    argvs = [[c] for c in COMMANDS if c not in ("serve", "bench")]
    argvs += [["bench", k] for k in BENCHMARKS]
    with (
        mock.patch.object(argparse.ArgumentParser, "parse_args", stop),
        mock.patch.object(argparse.ArgumentParser, "parse_known_args", stop),
    ):
        for argv in argvs:
            try:
                cli.main(argv)
            except Built as e:
                found[" ".join(argv)] = e.args[0]
    return found


def test_every_subcommand_says_its_own_usage_and_helps_every_flag():
    """Defect: subcommands said `usage: pdserve [-h]` (or `bench_vs`, `python -m ...`),
    flags had no help, and examples' line continuations were collapsed into one line."""
    import argparse

    parsers = _parsers()
    assert len(parsers) == len(COMMANDS) - 2 + len(BENCHMARKS)
    bad = []
    for name, p in parsers.items():
        want = "pdserve bench" if name == "bench serving" else f"pdserve {name}"
        if p.prog != want:
            bad.append(f"{name}: usage says {p.prog!r}")
        bad += [
            f"{name}: {a.option_strings or a.dest} has no help"
            for a in p._actions
            if not a.help and not isinstance(a, argparse._HelpAction)
        ]
        bad += [
            f"{name}: collapsed: {line.strip()[:60]}"
            for line in (p.description or "").splitlines()
            if re.search(r"\S {4,}--", line)
        ]
    assert not bad, bad
