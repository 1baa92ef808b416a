"""The user documentation stays short, linked and self-contained.

- README.md is at most 300 lines, and its test command is the one `.ci/run` runs.
- Every relative link in README.md, docs/*.md and recipes/README.md reaches an existing file,
  and a link's `#anchor` names a heading of that file (GitHub's anchor rule).
- No file users get cites a document they do not have: the design notes the project was
  written from ("SPEC 2.1", "seeds/002", "seed 002") are not in the repository, so code,
  configs and docs say what they mean or link a page in docs/ instead.
- Nothing speaks of how the project was made: no issue numbers ("issue 12", "#24 item 7"),
  "round 3" or the like; a cited upstream project's issue names the project ("s3prl issue").
- docs/attention.md documents every registered variant and each of its options.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, ROOT / "recipes" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_BLOCK = re.compile(r"^```.*?^```", re.S | re.M)
# "SPEC 2.1", "(SPEC)", "seeds/000", "seed 002": references to the documents the project was
# built from. A random seed ("seed=1", "the seed option", "seeds CUDA generators") is not one.
OUTSIDE_REFERENCE = re.compile(r"\bSPEC\b|\bseeds?/\d|\bseeds? \d{3}\b")
# "issue 12", "issue #24", "issues 3 and 4", "round 3", a section rule numbered after an issue
# ("# ---- 12: one run"); not another project's tracker, which
# is named on the line ("s3prl issue #22", a github.com link)
PROCESS_WORDS = re.compile(r"\bissues? #?\d+|\bround \d+\b|^# -+ \d+[:,]", re.I)
ELSEWHERE = re.compile(r"github\.com|\bs3prl\b|\blhotse\b|\btorch\b|\bpytorch\b", re.I)
SCANNED = [
    *sorted((ROOT / "speechattn").rglob("*.py")),
    *sorted((ROOT / "conf").rglob("*.yaml")),
    *sorted((ROOT / "recipes").glob("*")),
    *sorted((ROOT / "scripts").glob("*")),
    *PAGES,
    ROOT / "hubconf.py",
    *(p for p in sorted((ROOT / "tests").rglob("*.py")) if p.name != "test_docs.py"),
]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to '-'."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = CODE_BLOCK.sub("", page.read_text())
    return {_anchor(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def _fenced_block_after(text: str, marker: str) -> str:
    """The first line of the first ``` block after `marker`."""
    rest = text[text.index(marker) :]
    block = re.search(r"^```\w*\n(.*?)\n", rest, re.M)
    assert block, f"no code block after {marker!r}"
    return block.group(1).strip()


def test_readme_is_short() -> None:
    lines = README.read_text().count("\n")
    assert lines <= 300, f"README.md has {lines} lines (limit 300): move details into docs/"


def test_readme_test_command_is_what_ci_runs() -> None:
    readme_cmd = _fenced_block_after(README.read_text(), "Run the tests")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    marker = next(i for i, line in enumerate(ci) if "README test command" in line)
    ci_cmd = ci[marker + 1].strip()
    assert readme_cmd.endswith(ci_cmd), (readme_cmd, ci_cmd)
    # The README's line creates and activates the environment first; CI does that itself.
    assert readme_cmd.startswith("python3.11 -m venv .venv && . .venv/bin/activate && ")


def test_readme_quick_start_runs_the_main_job() -> None:
    cmd = _fenced_block_after(README.read_text(), "## Quick start")
    assert cmd == (
        "python3.11 -m venv .venv && . .venv/bin/activate && pip install -e . "
        "&& python -m speechattn.pretrain attention=ldsa"
    )


def test_anchor_rule() -> None:
    assert _anchor("## torch.compile"[3:]) == "torchcompile"
    assert _anchor("Precision and the GPU path") == "precision-and-the-gpu-path"
    assert _anchor("Listing and cleaning: `ls` and `gc`") == "listing-and-cleaning-ls-and-gc"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(CODE_BLOCK.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT)}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


def _scanned_lines(matches: Callable[[str], bool]) -> list[str]:
    """`path:line: text` of every line of the scanned files that `matches`."""
    found = []
    for path in SCANNED:
        if path.is_file():
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if matches(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    return found


def test_no_references_to_documents_users_do_not_have() -> None:
    found = _scanned_lines(lambda line: bool(OUTSIDE_REFERENCE.search(line)))
    assert not found, (
        "these cite documents that are not in the repository; say what is meant, or link "
        "the docs/ page that defines it:\n" + "\n".join(found)
    )


def test_no_process_words() -> None:
    found = _scanned_lines(
        lambda line: bool(PROCESS_WORDS.search(line)) and not ELSEWHERE.search(line)
    )
    assert not found, (
        "these speak of how the project was made (issue numbers, rounds); say what the code "
        "does and why instead:\n" + "\n".join(found)
    )


def test_attention_page_documents_every_variant_and_option() -> None:
    from speechattn.attention import available
    from speechattn.attention.base import AttentionConfig
    from speechattn.attention.registry import get

    page = (ROOT / "docs" / "attention.md").read_text()
    shared = {f.name for f in dataclasses.fields(AttentionConfig)}
    missing = []
    for name in available():
        if f"`{name}`" not in page:
            missing.append(f"variant `{name}`")
        for field in dataclasses.fields(get(name).Config):
            if field.name not in shared and f"`{field.name}`" not in page:
                missing.append(f"option `{field.name}` of `{name}`")
    assert not missing, "docs/attention.md does not document: " + ", ".join(missing)
