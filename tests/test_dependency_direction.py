"""Dependency direction between the package's layers: builder, configs, quantization, runtime and quantizer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1]  # the repository root is the trtbuild package


def imported_modules(path: Path) -> set[str]:
    """Every module a source file imports, anywhere in it (function-level imports included), as dotted names:
    `from trtbuild import runtime` counts as trtbuild.runtime."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import of {node.module}"
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


@pytest.mark.parametrize(("sources", "forbidden"), [
    ("builder/**/*.py", ("trtbuild.runtime", "trtbuild.quantize")),
    ("configs/**/*.py", ("trtbuild.builder", "trtbuild.runtime", "trtbuild.quantize")),
    ("quantization.py", ("trtbuild.builder", "trtbuild.runtime", "trtbuild.quantize")),
])
def test_dependency_direction(sources, forbidden):
    """The builder compiles checkpoints without the runtime or the quantizer; configs and the shared quantization
    vocabulary (trtbuild.quantization) depend on neither the builder, the runtime nor the quantizer."""
    files = sorted(PACKAGE.glob(sources))
    assert files, sources
    bad = {f"{path.relative_to(PACKAGE)}: {name}" for path in files for name in imported_modules(path)
           if any(name == m or name.startswith(m + ".") for m in forbidden)}
    assert not bad, sorted(bad)
