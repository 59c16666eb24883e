"""The layout's rules that import-linter's contracts do not state: no import cycle, short modules,
no hidden (function-level) imports of our own code, comments that cite symbols rather than paths.

The layers themselves are `[tool.importlinter]` contracts in pyproject.toml, run by `lint-imports`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "engine_daemon", "http_frontend", "model_builders")
MAX_LINES = 450
# Function-level imports of our own modules that are there on purpose, each with its reason.
LAZY_IMPORTS_ALLOWED = {
    # MLX loads with these; `engined --help`, `engined keygen` and a refused configuration never need it.
    "engine_daemon.cli": {"engine_daemon.cpu.blas_check", "engine_daemon.cpu.parallel_ops",
                          "engine_daemon.cpu.prefill_attention", "engine_daemon.cpu.prefill_swiglu",
                          "engine_daemon.cpu.decode_attention",
                          "engine_daemon.transport.server",
                          "engine_daemon.generation.speculative", "engine_daemon.scheduling.follower"},
    # mlx-audio's Whisper decoding loads with it (subclassed at import); only a loaded Whisper needs it.
    "engine_daemon.auxiliary.transcription": {"engine_daemon.auxiliary.whisper_steps"},
}


def product_files() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_cycle_lazy_imports_included() -> None:
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True)
    # Tarjan's strongly connected components over module -> module edges.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    assert cycles == []


@pytest.mark.parametrize("path", product_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_is_short(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= MAX_LINES


def test_no_hidden_imports_of_our_own_modules() -> None:
    found = {}
    for path in product_files():
        module = module_name(path)
        tree = ast.parse(path.read_text())
        top_level = set(map(id, tree.body))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in top_level:
                continue
            names = _imported_modules(node)
            ours = {n for n in names if n.split(".")[0] in PACKAGES}
            if isinstance(node, ast.ImportFrom) and node.level:
                ours.add(f"(relative) {node.module}")
            unexpected = ours - LAZY_IMPORTS_ALLOWED.get(module, set())
            if unexpected and not _under_type_checking(tree, node):
                found.setdefault(module, set()).update(unexpected)
    assert found == {}


def _imported_modules(node: ast.Import | ast.ImportFrom) -> list[str]:
    """Module names an import statement loads (`from a import b` loads a.b when b is a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    names = []
    for alias in node.names:
        candidate = f"{base}.{alias.name}"
        path = ROOT.joinpath(*candidate.split("."))
        names.append(candidate if path.with_suffix(".py").exists() or path.is_dir() else base)
    return names


def _under_type_checking(tree: ast.Module, target: ast.AST) -> bool:
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            if any(child is target for child in ast.walk(node)):
                return True
    return False


PATH_CITATION = re.compile(r"\b(?:engine_daemon|http_frontend|protocol|model_builders|tests)/[\w/]*\.py\b"
                           r"|\b(?!__init__|__main__)\w+\.py\b")


def test_comments_cite_symbols_not_paths() -> None:
    """Paths in comments and docstrings rot on every move; a symbol is found by search and checked by tools."""
    citing = []
    for path in product_files():
        source = path.read_text()
        texts = [tok for tok in _comments_and_docstrings(source)]
        citing += [f"{path.relative_to(ROOT)}: {m.group()}" for text in texts for m in PATH_CITATION.finditer(text)]
    assert citing == []


def _comments_and_docstrings(source: str) -> list[str]:
    import io
    import tokenize

    texts = [tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node, clean=False)
            if docstring:
                texts.append(docstring)
    return texts
