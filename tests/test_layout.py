"""The layering the layout promises: the roles never import one another, no server imports the
client library, and the engine imports no service code. Read from the source with ast, so a
violation fails here even on a path no other test runs."""

from __future__ import annotations

import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
ROLES = {"router": "splitserve.router", "prefill_worker": "splitserve.prefill_worker",
         "decode_worker": "splitserve.decode_worker"}  # fmt: skip


def imports_of(folder: pathlib.Path) -> dict[str, set[str]]:
    """Each .py file under folder -> the modules it imports (absolute names)."""
    out = {}
    for path in sorted(folder.rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
        out[str(path.relative_to(REPO))] = names
    return out


def offenders(folder: str, banned: tuple[str, ...]) -> list[str]:
    return [
        f"{path} imports {name}"
        for path, names in imports_of(REPO / folder).items()
        for name in sorted(names)
        if any(name == b or name.startswith(b + ".") for b in banned)
    ]


@pytest.mark.parametrize("role", sorted(ROLES))
def test_a_role_imports_no_other_role_and_not_the_client(role):
    others = tuple(module for folder, module in ROLES.items() if folder != role)
    assert offenders(role, (*others, "splitserve.client", "splitserve.cli")) == []


def test_the_shared_service_code_imports_no_role_and_not_the_client():
    assert offenders("splitserve/service", (*ROLES.values(), "splitserve.client", "splitserve.cli")) == []


def test_the_handoffs_shared_parts_import_no_role_and_no_service_code():
    assert offenders("splitserve/handoff", (*ROLES.values(), "splitserve.service", "splitserve.client")) == []


def test_the_engine_imports_no_service_code():
    banned = (*ROLES.values(), "splitserve.service", "splitserve.client", "splitserve.cli", "splitserve.stack")
    assert offenders("splitserve/engine", banned) == []


def test_the_check_finds_an_import_it_bans(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("from splitserve.client import Client\nimport os\n")
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    assert offenders("pkg", ("splitserve.client",)) == ["pkg/m.py imports splitserve.client"]
