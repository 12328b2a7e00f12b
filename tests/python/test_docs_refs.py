"""The code's references to the project's documents point at files in this repository, and every
``docs/spec.md §n`` names a section that exists there (the behaviour contract lives in docs/)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [
    p
    for d in ("src", "python", "tests", "benches", "examples", "scripts")
    for p in (ROOT / d).rglob("*")
    if p.suffix in {".rs", ".py", ".pyi", ".sh", ".md", ".cu"} and p.is_file()
] + [ROOT / "README.md", ROOT / "BENCHMARKS.md"]


def _texts() -> list[tuple[Path, str]]:
    return [(p, p.read_text(errors="replace")) for p in SOURCES if p.exists() and p != Path(__file__)]


def test_no_reference_to_documents_outside_the_repo() -> None:
    bad = [
        f"{p.relative_to(ROOT)}: {m.group(0)!r}"
        for p, t in _texts()
        for m in re.finditer(r"\bSPEC §|(?<![/\w])(PERF|DESIGN|SPEC)\.md|shared/(SPEC|PERF|DESIGN)", t)
    ]
    assert not bad, "references to documents that are not in the repository:\n" + "\n".join(bad[:20])


def test_spec_sections_and_doc_files_exist() -> None:
    spec = (ROOT / "docs" / "spec.md").read_text()
    sections = set(re.findall(r"^#+ (§[0-9]+(?:\.[0-9]+)*)\b", spec, re.MULTILINE))
    assert {"§1", "§2", "§2.3", "§5", "§7", "§9"} <= sections, sorted(sections)
    missing = []
    for p, t in _texts():
        for m in re.finditer(r"docs/spec\.md (§[0-9]+(?:\.[0-9]+)*)", t):
            sec = m.group(1).rstrip(".")
            if sec not in sections:
                missing.append(f"{p.relative_to(ROOT)}: {m.group(0)}")
        for m in re.finditer(r"docs/([a-z_]+\.md)", t):
            if not (ROOT / "docs" / m.group(1)).exists():
                missing.append(f"{p.relative_to(ROOT)}: {m.group(0)}")
    assert not missing, "references to sections or files that do not exist:\n" + "\n".join(missing[:20])
