"""The store's Lua scripts: the files of common/store/lua/, read once from the package.

Every status transition and every append is one script, so each is atomic without WATCH
retries, and each is safe to run twice (a retried call after a dropped connection is a no-op).
Each file opens with its contract, a ``-- KEYS:`` and an ``-- ARGV:`` line naming what it takes
(tests/common/test_lua_contract.py checks every caller against them), and binds those names on its
first lines. A line ``--#include name`` stands for common/store/lua/lib/name.lua, a piece that
several scripts share (docs/internals.md, "Redis").
"""

from __future__ import annotations

import functools
import re
from importlib.resources import files
from importlib.resources.abc import Traversable

_INCLUDE = re.compile(r"^--#include (\w+)$", re.MULTILINE)


def _folder() -> Traversable:
    return files("common.store") / "lua"


def _expand(text: str) -> str:
    """``text`` with each include line replaced by its piece (itself expanded)."""
    return _INCLUDE.sub(lambda m: _expand((_folder() / "lib" / f"{m[1]}.lua").read_text()).rstrip("\n"), text)


@functools.cache
def source(name: str) -> str:
    """The script ``name`` (common/store/lua/name.lua), its includes expanded."""
    return _expand((_folder() / f"{name}.lua").read_text())


def names() -> list[str]:
    """Every script's name, sorted."""
    return sorted(f.name.removesuffix(".lua") for f in _folder().iterdir() if f.name.endswith(".lua"))
