"""Check every engine name lean_tp's integrations import, subclass or override against an engine's
sources, without importing the engine (a GPU wheel's ``.py`` files, unpacked, are enough).

    python scripts/check_engine_names.py vllm /path/to/site-packages      # vLLM 0.32 / 0.33
    python scripts/check_engine_names.py sglang /path/to/site-packages    # SGLang 0.5.23

``pip download --no-deps vllm==0.33.0`` and ``unzip`` give a tree to point it at. It reports:
- every ``from <engine>... import name`` in ``lean_tp/integrations/<engine>/``: resolved to the
  module's top-level definition, or missing;
- every method of a lean class with an engine base: the engine class that defines it (an
  override), or lean's own. An engine method lean overrides that the engine renamed shows as lean's
  own, so the list is recorded in docs/vllm.md and docs/sglang.md and compared by hand.
Exits 1 if an import does not resolve.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

INTEGRATIONS = Path(__file__).resolve().parent.parent / "lean_tp" / "integrations"


def module_file(root: Path, module: str) -> Path | None:
    """The source file of a dotted module under ``root``: ``a/b.py`` or ``a/b/__init__.py``."""
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def top_level(tree: ast.Module) -> dict[str, ast.AST]:
    """Names a module defines or imports at its top level (``if TYPE_CHECKING`` and try blocks too)."""
    names: dict[str, ast.AST] = {}

    def visit(body):
        for node in body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names[node.name] = node
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    for leaf in ast.walk(target):
                        if isinstance(leaf, ast.Name):
                            names[leaf.id] = node
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names[node.target.id] = node
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    names[(alias.asname or alias.name).split(".")[0]] = node
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    return names


class Engine:
    """An engine's source tree, parsed on demand."""

    def __init__(self, root: Path):
        self.root = root
        self._trees: dict[str, dict[str, ast.AST] | None] = {}

    def names(self, module: str) -> dict[str, ast.AST] | None:
        if module not in self._trees:
            path = module_file(self.root, module)
            self._trees[module] = None if path is None else top_level(ast.parse(path.read_text()))
        return self._trees[module]

    def resolve(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        """(module, node) of ``name`` as ``module`` defines it, following re-exports; or a submodule."""
        names = self.names(module)
        if names is None or depth > 8:
            return None
        node = names.get(name)
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            original = next(a.name for a in node.names if (a.asname or a.name) == name)
            return self.resolve(node.module, original, depth + 1) or (module, node)
        if node is not None:
            return module, node
        if module_file(self.root, f"{module}.{name}") is not None:
            return f"{module}.{name}", ast.Module(body=[], type_ignores=[])
        return None

    def methods(self, module: str, cls: ast.ClassDef, depth: int = 0) -> dict[str, str]:
        """Method name -> defining class, over ``cls`` and the bases its module imports."""
        found = {}
        for base in cls.bases:
            base = base.value if isinstance(base, ast.Subscript) else base
            if isinstance(base, ast.Name) and depth < 12:
                resolved = self.resolve(module, base.id)
                if resolved and isinstance(resolved[1], ast.ClassDef):
                    found.update(self.methods(resolved[0], resolved[1], depth + 1))
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found[node.name] = f"{module}.{cls.name}"
            elif isinstance(node, (ast.AnnAssign, ast.Assign)):
                for leaf in ast.walk(node.target if isinstance(node, ast.AnnAssign) else node.targets[0]):
                    if isinstance(leaf, ast.Name):
                        found[leaf.id] = f"{module}.{cls.name}"
        return found


def report(engine_name: str, root: Path) -> list[tuple[str, str, str]]:
    """(kind, name, where) for every engine import ("ok" or "missing") and every method or class
    attribute of a lean class with an engine base ("override" or "own")."""
    engine, rows = Engine(root), []
    for path in sorted((INTEGRATIONS / engine_name).glob("*.py")):
        tree = ast.parse(path.read_text())
        imported: dict[str, tuple[str, str]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == engine_name:
                for alias in node.names:
                    imported[alias.asname or alias.name] = (node.module, alias.name)
                    ok = engine.resolve(node.module, alias.name) is not None
                    rows.append(("ok" if ok else "missing", f"{node.module}.{alias.name}", path.name))
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            bases = [b.value if isinstance(b, ast.Subscript) else b for b in cls.bases]
            engine_bases = [imported[b.id] for b in bases if isinstance(b, ast.Name) and b.id in imported]
            inherited: dict[str, str] = {}
            for module, name in engine_bases:
                resolved = engine.resolve(module, name)
                if resolved and isinstance(resolved[1], ast.ClassDef):
                    inherited.update(engine.methods(resolved[0], resolved[1]))
            members = [
                n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Assign, ast.AnnAssign))
            ]
            for node in members if engine_bases else []:
                for name in [node.name] if hasattr(node, "name") else _targets(node):
                    where = inherited.get(name, "")
                    rows.append(("override" if where else "own", f"{cls.name}.{name}", where))
    return rows


def _targets(node: ast.AST) -> list[str]:
    targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
    return [leaf.id for t in targets for leaf in ast.walk(t) if isinstance(leaf, ast.Name)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", choices=["vllm", "sglang"])
    parser.add_argument("root", type=Path, help="the directory holding the engine's package (site-packages)")
    args = parser.parse_args()
    rows = report(args.engine, args.root)
    for kind, name, where in rows:
        print(f"{kind:8} {name}  {where}")
    missing = sum(kind == "missing" for kind, _, _ in rows)
    print(f"{missing} unresolved import(s)")
    sys.exit(1 if missing else 0)


if __name__ == "__main__":
    main()
