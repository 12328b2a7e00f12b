#!/usr/bin/env python3
"""Fails when a file imports a file that imports it back (directly or through others).

Checked: the Rust files of `src/engine/cuda/` and `src/tier/` (edges: `super::NAME` reaching the
folder and `crate::engine::cuda::NAME` / `crate::tier::NAME` outside comments and `#[cfg(test)]`
modules, a name re-exported by `mod.rs` counting as the file that defines it) and the modules of
`python/kvoff/` (edges: `import` and `from ... import` of kvoff modules, also inside functions; not
those under `if TYPE_CHECKING:`). Prints each cycle found. For `src/tier/` also its layers
(`TIER_LAYERS`): format, memory -> secondary -> each tier's folder (file/, remote/, ...) -> chain;
a module imports only lower layers, so sibling tiers never import each other and `secondary` names
no tier. Run by scripts/test.sh; no arguments.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _strip_rust(text: str) -> str:
    """The file without comments and without its `#[cfg(test)]` modules."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = "\n".join(line.split("//", 1)[0] for line in text.splitlines())
    out, i = [], 0
    for m in re.finditer(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{", text):
        if m.start() < i:
            continue
        out.append(text[i : m.start()])
        depth, j = 1, m.end()
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        i = j
    out.append(text[i:])
    return "".join(out)


def _heads(group: str) -> list[str]:
    """First path segment of each item of a `{a, b::c, d::{e}}` use group."""
    items, depth, cur = [], 0, ""
    for ch in group:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    items.append(cur)
    return [re.split(r"::|\s", it.strip(), maxsplit=1)[0] for it in items if it.strip()]


def _rust_files(folder: Path, split: tuple[str, ...] = ()) -> dict[str, list[Path]]:
    """The modules of `folder` and their files: `name.rs`, or `name/mod.rs` with its submodules.

    A file of a directory module named in `split` (e.g. `bench.rs`) is a module of its own,
    `dir/name`, so that it can sit in another layer than the rest of its directory.
    """
    files = {p.stem: [p] for p in folder.glob("*.rs") if p.stem != "mod"}
    for d in folder.iterdir():
        if d.is_dir() and (d / "mod.rs").exists():
            own = []
            for p in sorted(d.rglob("*.rs")):
                if p.parent == d and p.name in split:
                    files[f"{d.name}/{p.stem}"] = [p]
                else:
                    own.append(p)
            files[d.name] = own
    return files


def rust_graph(folder: Path, crate_path: str, split: tuple[str, ...] = ()) -> dict[str, set[str]]:
    """Module -> the modules of `folder` it names (`super::` up to `folder`, or `crate_path::`)."""
    files = _rust_files(folder, split)
    mods = {m for m in files if "/" not in m}
    reexport: dict[str, str] = {}
    for m in re.finditer(r"pub(?:\([a-z]+\))?\s+use\s+(\w+)::(\{[^;]*\}|\w+)\s*;", _strip_rust((folder / "mod.rs").read_text())):
        names = _heads(m.group(2)[1:-1]) if m.group(2).startswith("{") else [m.group(2)]
        for n in names:
            reexport[n] = m.group(1)
    path_re = re.compile(r"(?<![\w:])((?:super::)+|" + re.escape(crate_path) + r"::)(\{|\w+)")
    graph: dict[str, set[str]] = {}
    for mod, paths in files.items():
        names: list[str] = []
        for p in paths:
            text = _strip_rust(p.read_text())
            # How many `super::` reach `folder` from this file: 1 from `folder/x.rs` and
            # `folder/x/mod.rs`, 2 from `folder/x/y.rs`, and so on.
            rel = p.relative_to(folder).parts
            up = len(rel) - (1 if p.name == "mod.rs" else 0)
            for m in path_re.finditer(text):
                if m.group(1).startswith("super") and m.group(1).count("super") != up:
                    continue
                if m.group(2) == "{":
                    depth, j = 1, m.end()
                    while j < len(text) and depth:
                        depth += {"{": 1, "}": -1}.get(text[j], 0)
                        j += 1
                    names.extend(_heads(text[m.end() : j - 1]))
                else:
                    names.append(m.group(2))
        own = mod.split("/")[0]
        deps = {n if n in mods else reexport.get(n, "") for n in names}
        graph[mod] = {d for d in deps if d and d != own}
    return graph


# The tier's layers (docs/design.md "Crate layout"): a module imports only modules of lower
# layers, so sibling tiers never import each other and `secondary` names no tier. Every
# directory of `src/tier/` not named here is a tier; a tier's `bench.rs` measures it through the
# chain.
TIER_LAYERS = {"format": 0, "memory": 0, "secondary": 1, "chain": 3, "registry": 3}
TIER_LAYER = 2
TIER_TOOL_LAYER = 4
TIER_NAMES = ("layer 0 (format, memory)", "layer 1 (secondary)", "layer 2 (a tier)", "layer 3 (chain, registry)", "layer 4 (a tier's bench)")


def tier_layer_errors(folder: Path) -> list[str]:
    graph = rust_graph(folder, "crate::tier", split=("bench.rs",))
    errors = []

    def layer(m: str) -> int | None:
        if "/" in m:
            return TIER_TOOL_LAYER
        if m in TIER_LAYERS:
            return TIER_LAYERS[m]
        return TIER_LAYER if (folder / m).is_dir() else None

    for mod in sorted(graph):
        lm = layer(mod)
        if lm is None:
            errors.append(f"src/tier/{mod}.rs is in no layer (add it to TIER_LAYERS in {Path(__file__).name})")
            continue
        for dep in sorted(graph[mod]):
            ld = layer(dep)
            if ld is not None and ld >= lm:
                errors.append(f"tier layers: {mod} ({TIER_NAMES[lm]}) imports {dep} ({TIER_NAMES[ld]})")
    return errors


def _module_of(path: Path, pkg_root: Path) -> str:
    rel = path.relative_to(pkg_root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def python_graph(pkg_root: Path) -> dict[str, set[str]]:
    files = {_module_of(p, pkg_root): p for p in pkg_root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        skip: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                for sub in node.body:
                    skip.update(id(n) for n in ast.walk(sub))
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")
                    up = up[: len(up) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for t in targets:
                # The longest known module that `t` names (a name imported from a module counts
                # as that module).
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t and t != mod and not mod.startswith(t + "."):
                    deps.add(t)
        graph[mod] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def main() -> int:
    bad = 0
    for name, graph in (
        ("src/engine/cuda", rust_graph(ROOT / "src/engine/cuda", "crate::engine::cuda")),
        ("src/tier", rust_graph(ROOT / "src/tier", "crate::tier", split=("bench.rs",))),
        ("python/kvoff", python_graph(ROOT / "python/kvoff")),
    ):
        for c in cycles(graph):
            bad += 1
            print(f"import cycle in {name}: " + ", ".join(c))
            for v in c:
                print(f"  {v} -> " + ", ".join(sorted(graph[v] & set(c))))
    for e in tier_layer_errors(ROOT / "src/tier"):
        bad += 1
        print(e)
    if not bad:
        print("no import cycles in src/engine/cuda, src/tier and python/kvoff; src/tier keeps its layers")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
