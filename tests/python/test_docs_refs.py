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


# --- BENCHMARKS.md: the commands it gives are real -------------------------------------------------

_BENCH = ROOT / "BENCHMARKS.md"
_ENV = r"(?:[A-Z][A-Z0-9_]*=\S*\s+)*"


def _benchmark_commands() -> list[str]:
    """Inline code spans of BENCHMARKS.md outside headings (a heading names a benchmark; the commands
    that reproduce a table sit in its text), newlines inside a span read as spaces (Markdown)."""
    body = "\n".join(line for line in _BENCH.read_text().splitlines() if not line.startswith("#"))
    return [" ".join(m.group(1).split()) for m in re.finditer(r"`([^`]+)`", body)]


def _kvoff_entry_point() -> tuple[str, str]:
    """The ``kvoff`` console script of pyproject.toml's ``[project.scripts]``, as (module, function)."""
    m = re.search(r'^kvoff\s*=\s*"([\w.]+):(\w+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert m, "no kvoff entry point in pyproject.toml"
    return m.group(1), m.group(2)


def test_benchmarks_kvoff_commands_parse() -> None:
    """Every ``kvoff ...`` command line of BENCHMARKS.md is accepted by the CLI's own parser (parsed
    only: the parser's result is caught before any benchmark runs)."""
    import argparse
    import importlib
    import shlex

    module, func = _kvoff_entry_point()
    main = getattr(importlib.import_module(module), func)
    cmds = [
        m.group(1)
        for c in _benchmark_commands()
        if (m := re.fullmatch(_ENV + r"(?:kvoff|python3? -m kvoff\.cli)\s+(.+)", c))
    ]
    assert any(c.startswith("bench ") for c in cmds), "no kvoff bench command found in BENCHMARKS.md"

    class Parsed(Exception):
        pass

    original = argparse.ArgumentParser.parse_args

    def parse_only(self: argparse.ArgumentParser, args: object = None, namespace: object = None) -> None:
        original(self, args, namespace)  # type: ignore[arg-type]
        raise Parsed

    bad = []
    argparse.ArgumentParser.parse_args = parse_only  # type: ignore[assignment,method-assign]
    try:
        for c in cmds:
            argv = shlex.split(c.replace("…", "X"))
            try:
                main(argv)
            except Parsed:
                continue
            except SystemExit as e:
                bad.append(f"kvoff {c}  (exit {e.code})")
            else:
                bad.append(f"kvoff {c}  (ran instead of parsing)")
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    assert not bad, "BENCHMARKS.md commands the CLI rejects:\n" + "\n".join(bad)


def test_benchmarks_cargo_and_script_commands_exist() -> None:
    """``cargo bench --bench NAME`` names a declared bench, ``KVOFF_*=`` variables in commands are read
    by the code, and ``scripts/gpu_check.sh STEP`` names a step that script has."""
    cargo = (ROOT / "Cargo.toml").read_text()
    benches = set(re.findall(r'^\[\[bench\]\]\s*name\s*=\s*"([\w-]+)"', cargo, re.MULTILINE))
    benches |= {p.stem for p in (ROOT / "benches").glob("*.rs")}
    code = "\n".join(
        p.read_text(errors="replace")
        for d in ("benches", "python", "src", "scripts")
        for p in (ROOT / d).rglob("*")
        if p.suffix in {".rs", ".py", ".sh"} and p.is_file()
    )
    gpu_check = (ROOT / "scripts" / "gpu_check.sh").read_text()
    steps = set(re.findall(r"^\s*([a-z]+)\)\s*$", gpu_check, re.MULTILINE))
    bad, seen = [], {"cargo": 0, "gpu_check": 0}
    for c in _benchmark_commands():
        for var in re.findall(r"\b(KVOFF_[A-Z0-9_]+)=", c):
            if not re.search(rf"\b{var}\b", code):
                bad.append(f"{c!r}: {var} is read nowhere")
        if m := re.fullmatch(_ENV + r"cargo bench(?: --no-run)?(.*)", c):
            seen["cargo"] += 1
            names = re.findall(r"--bench[ =](\S+)", m.group(1))
            bad += [f"{c!r}: no bench {n!r}" for n in names if n not in benches]
        if m := re.fullmatch(_ENV + r"scripts/gpu_check\.sh((?: [a-z]+)+)", c):
            seen["gpu_check"] += 1
            bad += [f"{c!r}: no step {s!r}" for s in m.group(1).split() if s not in steps]
    assert seen["cargo"] and seen["gpu_check"], seen
    assert not bad, "BENCHMARKS.md commands that name what does not exist:\n" + "\n".join(bad)


def _github_slug(heading: str) -> str:
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def test_benchmarks_internal_links_resolve() -> None:
    """BENCHMARKS.md's ``](#anchor)`` links point at one of its headings (GitHub's slugs)."""
    text = _BENCH.read_text()
    slugs = {_github_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.MULTILINE)}
    bad = [a for a in re.findall(r"\]\(#([^)]+)\)", text) if a not in slugs]
    assert not bad, f"links to headings that do not exist: {bad}"
