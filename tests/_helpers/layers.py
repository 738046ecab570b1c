"""The one AST walker of the layer tests: what a module imports."""

from __future__ import annotations

import ast
from pathlib import Path


def imported_names(path: Path) -> list[str]:
    """Every absolute module name a module imports, at module level or inside a function."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return names
