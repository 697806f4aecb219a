"""How a spool subcommand is declared: its --help says what it does, which settings it reads, and
gives an example."""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

SETTINGS_EXIT = 2  # a setting that cannot be, or a Redis that evicts keys
HELP_WIDTH = 88


def command(
    sub: Any, name: str, summary: str, details: str, settings: str, example: str
) -> argparse.ArgumentParser:
    """A subcommand whose --help says what it does, which settings it reads, and one example."""
    return sub.add_parser(  # type: ignore[no-any-return]
        name,
        help=summary,
        description="\n\n".join(
            textwrap.fill(text, HELP_WIDTH)
            for text in (f"{summary[0].upper()}{summary[1:]}. {details}", settings)
        ),
        epilog=f"example:\n  {example}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
