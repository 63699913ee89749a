"""Command-line flags made from the config dataclasses' fields.

A field that users set from the command line carries its flag in its metadata
(`flag(...)`): the name, the help, and the names vLLM gives the same setting.
The default is the field's own, so a flag's name, default and help live in one
place, beside the field. add_flags() puts a config's flags on a parser, and
flagged() reads them back as that config's keyword arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Flag:
    name: str  # --max-queue
    help: str
    aliases: tuple[str, ...] = ()  # other names for it (vLLM's, where it has one)
    parse: Callable[[str], Any] | None = None  # text -> value; default: the default's type
    metavar: str | None = None
    choices: tuple | None = None
    default_text: str | None = None  # the default as typed on the command line, when clearer


def flag(
    name: str,
    help: str,
    *aliases: str,
    parse: Callable[[str], Any] | None = None,
    metavar: str | None = None,
    choices: tuple | None = None,
    default_text: str | None = None,
) -> dict:
    """Field metadata: `x: int = field(default=1, metadata=flag("--x", "what x is"))`.
    A bool field's flag flips its default: --no-... for a field that is on unless told."""
    return {"flag": Flag(name, help, aliases, parse, metavar, choices, default_text)}


def flags_of(cls) -> list[tuple[dataclasses.Field, Flag]]:
    return [(f, f.metadata["flag"]) for f in dataclasses.fields(cls) if "flag" in f.metadata]


def add_flags(
    p: argparse.ArgumentParser,
    cls,
    title: str | None = None,
    only: tuple[str, ...] = (),
    more_help: dict[str, str] | None = None,
) -> None:
    """cls's flags (or only these fields'), in a group of their own if titled; more_help:
    text known only where the parser is made, added to a field's help."""
    g = p.add_argument_group(title) if title else p
    for f, fl in flags_of(cls):
        if only and f.name not in only:
            continue
        names = (fl.name, *fl.aliases)
        if f.type in (bool, "bool"):
            # NOTE: absent unless given, so flagged() leaves the field's own default.
            g.add_argument(
                *names,
                dest=f.name,
                help=fl.help,
                default=argparse.SUPPRESS,
                action="store_false" if f.default else "store_true",
            )
            continue
        has_default = f.default is not dataclasses.MISSING
        parse = fl.parse or (type(f.default) if has_default and f.default is not None else str)
        default = (
            fl.default_text if fl.default_text is not None else (f.default if has_default else None)
        )
        g.add_argument(
            *names,
            dest=f.name,
            type=parse,
            default=default,
            required=not has_default,
            metavar=fl.metavar
            or (None if fl.choices else fl.name.lstrip("-").upper().replace("-", "_")),
            choices=fl.choices,
            help="; ".join(filter(None, [fl.help, (more_help or {}).get(f.name)])),
        )


def flagged(cls, args: argparse.Namespace) -> dict:
    """The values of cls's flags that were put on the parser, by field name."""
    return {f.name: getattr(args, f.name) for f, _ in flags_of(cls) if hasattr(args, f.name)}


def markdown_table(cls) -> str:
    """cls's flags as a Markdown table (docs/configuration.md is made of these)."""
    rows = ["| flag | default | what it sets |", "| --- | --- | --- |"]
    for f, fl in flags_of(cls):
        if f.type in (bool, "bool"):
            default = "not given"  # a switch: giving it flips the field's default
        elif fl.default_text is not None:
            default = fl.default_text
        elif f.default is dataclasses.MISSING:
            default = "required"
        else:
            default = "none" if f.default is None else str(f.default)
        names = ", ".join(f"`{n}`" for n in (fl.name, *fl.aliases))
        text = fl.help.replace("|", "\\|") + (
            f" (one of {', '.join(map(str, fl.choices))})" if fl.choices else ""
        )
        rows.append(f"| {names} | {default} | {text} |")
    return "\n".join(rows)
