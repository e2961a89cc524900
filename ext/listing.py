"""Tables of the registered planners and compressors, from their specs: `gradsync list` prints them
and the README holds them between markers (``python -m gradsync.listing README.md`` rewrites them;
a test fails when they drift)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

from . import compress, planners
from .bibliography import link

def _value(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value >> 20} MiB"
    return repr(value)


def _options(pairs) -> str:
    return ", ".join(f"`{name}` ({_value(default)})" for name, default in pairs) or "—"


def scheduler_rows() -> list[list[str]]:
    return [[f"`{spec.name}`", f"`{spec.strategy_name}`", spec.description,
             _options((option.name, option.default) for option in spec.options), link(spec.source)]
            for spec in planners.registry]


def compressor_rows() -> list[list[str]]:
    return [[f"`{spec.name}`", f"`{spec.name}`" if spec.strategy else "—", spec.description,
             _options(spec.defaults().items()) + _aliases(spec.aliases), link(spec.source)]
            for spec in compress.registry]


def _aliases(aliases: dict[str, str]) -> str:
    return "; also " + ", ".join(f"`{alias}` for `{option}`" for alias, option in aliases.items()) if aliases else ""


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


TABLES = {
    "schedulers": lambda: markdown(["scheduler", "Lightning strategy", "what it does", "options (default)", "source"],
                                   scheduler_rows()),
    "compressors": lambda: markdown(["compressor", "Lightning strategy", "what it does", "options (default)",
                                     "source"], compressor_rows()),
}


def section(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- begin generated: {name} -->\n)(.*?)(<!-- end generated: {name} -->)", re.S)


def stale_tables(text: str) -> list[str]:
    """The tables of `text` (a README) that differ from the registries', or are missing."""
    stale = []
    for name, table in TABLES.items():
        found = section(name).search(text)
        if found is None or found.group(2) != table() + "\n":
            stale.append(name)
    return stale


def rewrite(path: Path) -> None:
    text = path.read_text()
    for name, table in TABLES.items():
        if section(name).search(text) is None:
            raise SystemExit(f"{path}: no '<!-- begin generated: {name} -->' ... '<!-- end generated: {name} -->'")
        text = section(name).sub(lambda found: found.group(1) + table() + "\n" + found.group(3), text)
    path.write_text(text)


if __name__ == "__main__":
    rewrite(Path(sys.argv[1] if len(sys.argv) > 1 else "README.md"))
