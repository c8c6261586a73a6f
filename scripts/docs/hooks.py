"""MkDocs hooks (mkdocs.yml `hooks:`): the pages' generated parts, rendered at build time so
that they cannot drift from the code or the stored results.

A page asks for them with one marker on a line of its own:

    <!-- config-reference -->      EngineConfig and ServeConfig fields, and every command's flags
    <!-- models-reference -->      the architectures, GGUF tensor types and precisions the native
                                   backend takes
    <!-- results: NAME -->         the table of docs/results/NAME.json (written by
                                   scripts/bench/record.py, or converted from an older record)

A marker naming a missing results file fails the build; a results file that no page shows is
a warning, which `mkdocs build --strict` (make docs) turns into a failure too.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import json
import logging
import re
import tokenize
from pathlib import Path

log = logging.getLogger("mkdocs.plugins.specdec")

RESULTS_DIR = Path(__file__).resolve().parents[2] / "docs" / "results"
MARKER = re.compile(r"^<!-- (config-reference|models-reference|results: ([\w.-]+)) -->$", re.MULTILINE)
_shown: set[str] = set()


def on_pre_build(config) -> None:
    _shown.clear()


def on_page_markdown(markdown: str, page, config, files) -> str:
    def render(match: re.Match) -> str:
        if match.group(1) == "config-reference":
            return config_reference()
        if match.group(1) == "models-reference":
            return models_reference()
        _shown.add(match.group(2))
        return results_table(match.group(2))

    return MARKER.sub(render, markdown)


def on_post_build(config) -> None:
    for path in sorted(RESULTS_DIR.glob("*.json")):
        if path.stem not in _shown:
            log.warning("docs/results/%s is shown on no page (add <!-- results: %s --> to one)", path.name, path.stem)


# ---- results ---------------------------------------------------------------------------------


def results_table(name: str) -> str:
    path = RESULTS_DIR / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"a page shows <!-- results: {name} -->, but there is no {path}")
    record = json.loads(path.read_text())
    machine = record["machine"]
    lines = [f"**{record['title']}**", "",
             f"CPU: {machine['cpu']}; threads: {machine['threads']}; commit `{record['commit']}`; "
             f"date {record['date']}.", ""]
    if record.get("provenance"):
        lines += [f"*Provenance:* {record['provenance']}", ""]
    lines += ["```", record["command"], "```", ""]
    if record.get("rerun"):
        lines += ["Re-run and record: `" + record["rerun"] + "`", ""]
    columns, rows = record.get("columns"), record.get("rows")
    if columns is None:  # a script's own JSON, recorded as it came
        columns, rows = ["key", "value"], _flatten(record["raw"])
    lines.append("| " + " | ".join(columns) + " |")
    lines.append("|" + "---|" * len(columns))
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    if record.get("notes"):
        lines += ["", record["notes"]]
    return "\n".join(lines) + "\n"


def _cell(value) -> str:
    return "–" if value is None else str(value).replace("|", "\\|")


def _flatten(value, prefix: str = "") -> list[list]:
    if isinstance(value, dict):
        return [row for key, v in value.items() for row in _flatten(v, f"{prefix}{key}.")]
    return [[prefix.rstrip("."), json.dumps(value) if isinstance(value, list) else value]]


# ---- models ----------------------------------------------------------------------------------


def models_reference() -> str:
    from specdec.backends.native.arch import SUPPORTED_TYPES
    from specdec.backends.native.kernels.precisions import PRECISIONS
    from specdec.backends.native.quant_types import SUPPORTED_NAMES
    from specdec.gguf_file import MODEL_TYPES

    def names(values) -> str:
        return ", ".join(f"`{v}`" for v in values)

    return "\n".join([
        "| the native backend takes | from the code |", "|---|---|",
        f"| model types (a Hugging Face directory's `config.json`) | {names(SUPPORTED_TYPES)} "
        "(`backends/native/arch/`) |",
        f"| GGUF architectures | {names(MODEL_TYPES)} (`gguf_file.py`; mistral files are `llama`) |",
        f"| GGUF tensor types | {names(SUPPORTED_NAMES)} (`backends/native/quant_types.py`) |",
        f"| weight precisions (`--backend-option precision=...`) | {names(PRECISIONS)} "
        "(`backends/native/kernels/precisions.py`) |", ""])


# ---- configuration reference ----------------------------------------------------------------


def config_reference() -> str:
    from specdec.cli import build_parser
    from specdec.config import ALIASES, EngineConfig
    from specdec.serve.settings import ServeConfig

    aliases: dict[str, list[str]] = {}
    for key, name in ALIASES.items():
        if key != name:
            aliases.setdefault(name, []).append(key)
    parts = ["### `EngineConfig`", "", _first_paragraph(EngineConfig), "", _fields_table(EngineConfig, aliases), "",
             "### `ServeConfig`", "", _first_paragraph(ServeConfig), "", _fields_table(ServeConfig), ""]
    for name, sub, text in _commands(build_parser()):
        table = _flags_table(sub)
        if table.count("\n") > 1:  # not a bare group of sub-commands
            parts += [f"### `specdec {name}`", "", text, "", table, ""]
    return "\n".join(parts)


def _first_paragraph(cls) -> str:
    doc = inspect.getdoc(cls) or ""
    if not doc or doc.startswith(cls.__name__ + "("):  # the dataclass's own signature
        return f"Defined in `{cls.__module__}`."
    return doc.split("\n\n")[0].replace("\n", " ") + f" (`{cls.__module__}`)"


def _field_comments(cls) -> dict[str, str]:
    """name -> the comment on the field's line, else the comment lines right above it."""
    source = inspect.getsource(cls)
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    lines = source.splitlines()
    out = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            line = node.lineno
            if line in comments and not lines[line - 1].lstrip().startswith("#"):
                out[node.target.id] = comments[line]
                continue
            above = []
            while line - 1 in comments and lines[line - 2].lstrip().startswith("#"):
                line -= 1
                above.insert(0, comments[line])
            out[node.target.id] = " ".join(above)
    return out


def _fields_table(cls, aliases: dict[str, list[str]] | None = None) -> str:
    """One row per field; `aliases`: other names a config file may use for a field."""
    comments = _field_comments(cls)
    rows = ["| field | type | default | |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        text = f.metadata.get("help") or f.metadata.get("setting", {}).get("help") or comments.get(f.name, "")
        if aliases and aliases.get(f.name):
            text += " (in a file also: " + ", ".join(f"`{a}`" for a in aliases[f.name]) + ")"
        rows.append(f"| `{f.name}` | `{_type_name(f.type)}` | {_default(f)} | {_cell(text)} |")
    return "\n".join(rows)


def _type_name(annotation) -> str:
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return f"`{f.default!r}`"
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return "`" + (type(value).__name__ + "()" if dataclasses.is_dataclass(value) else repr(value)) + "`"
    return "(required)"


def _commands(parser: argparse.ArgumentParser, prefix: str = ""):
    """(name, parser, help) of every command that takes flags, sub-commands included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                text = helps.get(name, "")
                yield prefix + name, sub, (text[:1].upper() + text[1:] + ".") if text else ""
                yield from _commands(sub, prefix + name + " ")


def _flags_table(parser: argparse.ArgumentParser) -> str:
    rows = ["| flag | default | |", "|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        flag = ", ".join(action.option_strings) or action.dest
        if action.choices and not isinstance(action.choices, dict):
            flag += " {" + ",".join(map(str, action.choices)) + "}"
        elif action.metavar:
            flag += f" {action.metavar}"
        default = "" if action.default in (None, [], False, argparse.SUPPRESS) else f"`{action.default}`"
        rows.append(f"| `{flag}` | {default} | {_cell(action.help or '')} |")
    return "\n".join(rows)
