"""The layers' imports point one way (docs/internals.md): checked on what Python really loads."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_engine_loads_no_redis_celery_fastapi_or_common() -> None:
    code = (
        "import sys, workers.engine, workers.engine.tiny\n"
        "banned = ('redis', 'celery', 'kombu', 'fastapi', 'starlette', 'common')\n"
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in banned)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == ""


def test_routes_never_import_routes() -> None:
    for path in sorted((ROOT / "api" / "routes").glob("*.py")):
        tree = ast.parse(path.read_text())
        imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in imported if m.startswith("api.routes")], path.name


def loaded(module: str, banned: tuple[str, ...]) -> list[str]:
    """The modules of ``banned`` (top-level names or whole dotted ones) that importing ``module``
    loads, in a fresh interpreter."""
    code = (
        f"import sys, {module}\n"
        f"banned = {banned!r}\n"
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in banned or m in banned\n"
        "    or any(m.startswith(b + '.') for b in banned))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return result.stdout.split()


def test_the_hook_worker_loads_no_torch() -> None:
    assert loaded("workers.hooks.tasks", ("torch", "transformers", "diffusers", "workers.engine")) == []


def test_the_media_worker_loads_no_text_engine() -> None:
    """Its runtime shares the task outcome, the publisher and liveness with the text worker's, not
    the text engine (nor xgrammar and transformers behind it)."""
    assert loaded("workers.media.tasks", ("workers.engine", "workers.runtime", "xgrammar")) == []


def test_the_api_loads_no_torch() -> None:
    assert loaded("api.main", ("torch", "transformers", "diffusers", "xgrammar", "workers")) == []


def imports_of(path: Path) -> set[str]:
    """The modules a file names in its imports (``from m import n`` counts as m and m.n)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def test_no_two_modules_import_each_other() -> None:
    # Two modules that import each other are one concept in two files (a package and its own
    # modules excepted).
    imports: dict[str, set[str]] = {}
    for package in ("api", "common", "workers", "spool_cli"):
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            imports[name] = imports_of(path)
    circles = [
        (a, b)
        for a, deps in imports.items()
        for b in deps
        if a < b and a in imports.get(b, ()) and not (a.startswith(b + ".") or b.startswith(a + "."))
    ]
    assert circles == []
