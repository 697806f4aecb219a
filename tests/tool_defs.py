"""The function tools the tool-calling tests share: a forecast with a constrained schema, and a
ping without parameters."""

from __future__ import annotations

from typing import Any

FORECAST: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "forecast",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "days", "unit"],
            "additionalProperties": False,
        },
    },
}
PING: dict[str, Any] = {
    "type": "function",
    "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}},
}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (FORECAST, PING)}
