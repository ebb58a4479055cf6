"""The README stays a one-screen page that is true: its size, its links and anchors, and every
command, flag, make target, path and metric name it shows."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
MAX_BYTES = 16_000


def anchors(page: pathlib.Path) -> set[str]:
    """GitHub's (and mkdocs') anchors of a Markdown page's headings."""
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return out


def test_the_readme_is_short():
    assert len(README.encode()) <= MAX_BYTES


def test_every_link_resolves_and_every_anchor_exists():
    links = re.findall(r"\]\(([^)\s]+)\)", README)
    assert len(links) > 10
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        path, _, anchor = link.partition("#")
        target = REPO / path if path else REPO / "README.md"
        assert target.exists(), link
        if anchor:
            assert anchor in anchors(target), link


def shown_commands() -> list[list[str]]:
    """Each `splitserve SUBCOMMAND ...` line of the README's code blocks, split into words."""
    out, fence = [], None
    for line in README.splitlines():
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip()
        elif fence == "sh":
            words = line.split("#", 1)[0].split()
            for i, w in enumerate(words[:-1]):  # the program itself, not an argument (kubectl -n splitserve)
                if (w == "splitserve" or w.endswith("/splitserve")) and not (i and words[i - 1].startswith("-")):
                    out.append(words[i + 1 :])
    return out


def test_the_readme_shows_commands_to_check():
    assert {c[0] for c in shown_commands()} >= {"generate", "traces", "request", "status"}


@pytest.mark.parametrize("words", shown_commands(), ids=lambda w: " ".join(w))
def test_every_command_and_flag_shown_exists(words):
    help_ = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", words[0], "--help"], capture_output=True, text=True, timeout=120
    )
    assert help_.returncode == 0, help_.stderr
    for flag in (w for w in words[1:] if w.startswith("--")):
        assert flag in help_.stdout, f"splitserve {words[0]} has no {flag}"


def test_every_make_target_shown_exists():
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    shown = set(re.findall(r"(?:^|\s)make ([\w-]+)", README, re.M))
    assert shown >= {"run", "test"} and shown <= targets, shown - targets


def test_every_path_and_metric_shown_exists():
    for path in re.findall(r"(deploy/[\w/.-]+|splitserve/[\w/.-]+/)", README):
        assert (REPO / path).exists(), path
    metrics = (REPO / "splitserve" / "observability" / "metrics.py").read_text()
    shown = set(re.findall(r"`splitserve_(\w+)`", README))
    assert len(shown) >= 5
    for name in shown:
        base = name.removesuffix("_total")
        assert f'"{base}"' in metrics, f"no metric splitserve_{name}"
