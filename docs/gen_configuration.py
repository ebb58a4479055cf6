"""Write the settings table of docs/configuration.md from the settings code.

    python docs/gen_configuration.py           # rewrite the table in place
    python docs/gen_configuration.py --check   # exit 1 if the page is out of date (make test runs it)

Each setting is a field of ``splitserve.service.settings.Settings``; its meaning is the comment
directly above the field, and its group the section comment (``# -- Router settings --``) above
that. The table sits between two markers in the page; the prose around it is written by hand.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"
SOURCE = ROOT / "splitserve" / "service" / "settings.py"
BEGIN, END = "<!-- settings:begin (docs/gen_configuration.py) -->", "<!-- settings:end -->"


def comments_above(lines: list[str], lineno: int) -> tuple[list[str], str]:
    """The comment lines directly above line ``lineno`` (1-based), and the section they are in."""
    out, i = [], lineno - 2
    while i >= 0 and lines[i].strip().startswith("#") and not lines[i].strip().startswith("# --"):
        out.insert(0, lines[i].strip()[1:].strip())
        i -= 1
    section = ""
    for j in range(lineno - 2, -1, -1):
        s = lines[j].strip()
        if s.startswith("# --"):
            section = s.strip("# -").replace(" settings", "")
            break
    return out, section


def default_text(settings, name: str) -> str:
    value = str(getattr(settings, name))
    home = os.path.expanduser("~")
    return "~" + value[len(home) :] if value.startswith(home + os.sep) else value


def table() -> str:
    sys.path.insert(0, str(ROOT))
    from splitserve.service.settings import Settings, env_name

    lines = SOURCE.read_text().split("\n")
    cls = next(n for n in ast.parse(SOURCE.read_text()).body if isinstance(n, ast.ClassDef) and n.name == "Settings")
    docs = {n.target.id: comments_above(lines, n.lineno) for n in cls.body if isinstance(n, ast.AnnAssign)}
    defaults = Settings()
    rows, section = [], None
    for f in dataclasses.fields(Settings):
        meaning, sec = docs[f.name]
        if sec != section:
            section = sec
            rows.append(f"| **{sec or 'Shared'}** | | |")
        text = " ".join(meaning).replace("|", "\\|")
        if not text:
            raise SystemExit(f"Settings.{f.name} has no comment above it: say what it is")
        default = default_text(defaults, f.name)
        rows.append(f"| `{env_name(f.name)}` | {f'`{default}`' if default else '(empty)'} | {text} |")
    return "\n".join(["| variable | default | meaning |", "|---|---|---|", *rows])


def render(page: str) -> str:
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main(argv: list[str]) -> int:
    page = PAGE.read_text()
    want = render(page)
    if "--check" in argv:
        if want != page:
            print(f"{PAGE.relative_to(ROOT)} is out of date: run python docs/gen_configuration.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(want)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
