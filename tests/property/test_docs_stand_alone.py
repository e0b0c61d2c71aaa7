"""The docs stand alone: nothing a user reads (README, docs/, examples/, bench/, the package's
docstrings and messages) points to a document outside the repository."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Documents of the workplace the repository was written in, which a user does not have: its
# API contract, style guide and reference notes, cited by name or by section number.
OUTSIDE = re.compile(
    r"\b(?:API|STYLE)\.md\b"  # API.md, STYLE.md
    r"|\b(?:API|STYLE)\s*§"  # API §4, STYLE §2.6
    r"|\b[Rr]eference\s*§"  # reference §7.4
    r"|\breference/[\w-]+\.md\b"  # reference/engines.md
    r"|\bnemo_rl_configs/"  # reference/nemo_rl_configs/
    r"|\.\./shared/|\bshared/API"  # ../shared/API.md
    r"|\(§\s*\d|^\s*§\s*\d|\s§\d"  # a bare section number: whose?
)


def _user_facing_files():
    for pattern in (
        "README.md",
        "docs/**/*.md",
        "examples/**/*",
        "bench/**/*.py",
        "policyworker/**/*.py",
        "pyproject.toml",
        "Makefile",
    ):
        for path in sorted(ROOT.glob(pattern)):
            if path.is_file() and "results" not in path.parts:
                yield path


def test_no_user_facing_file_cites_a_document_outside_the_repository():
    hits = []
    for path in _user_facing_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not hits, "say the fact or link a doc in the repository:\n" + "\n".join(hits)


def test_the_pattern_catches_each_kind_of_outside_reference():
    for text in (
        "see API.md §4",
        "(API §7 'Process group')",
        "reference §7.4 rule",
        "Vocab parallel (STYLE.md §2.6)",
        "STYLE §2.6",
        "reference/engines.md §1.3",
        "`../shared/API.md` (in the workplace)",
        "the rule of (§5.3)",
    ):
        assert OUTSIDE.search(text), text
    for text in ("see docs/refit-protocol.md", "the reference weights", "reference_policy_kl"):
        assert not OUTSIDE.search(text), text
