"""The configuration's keys as cfg/default.yaml declares them: the one source of truth for each key's default, type,
allowed values and help. Each line reads `key: value # (types; rule; ...) help`, where a rule is `> 0`, `>= 0`,
`0 to 1`, `multiple of N` or `one of a, b` (for a key that also takes other types: the strings it takes).

keys.py is the typed view of the same keys, generated from the file by `python -m yoloaccum.config.schema` and checked
against it by a test, so that type checkers and editors know every key's type.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

_PACKAGE = Path(__file__).resolve().parents[1]  # yoloaccum/
# Source checkouts and editable installs keep cfg/ beside the package; wheels carry a copy inside it.
DEFAULT_CFG = next(
    (p for p in (_PACKAGE / "cfg/default.yaml", _PACKAGE.parent / "cfg/default.yaml") if p.exists()),
    _PACKAGE.parent / "cfg/default.yaml",
)
_LINE = re.compile(
    r"^(?P<key>[a-z_0-9]+):(?P<value>[^#]*)#\s*\((?P<type>[a-z |]+)(?P<rules>(;[^)]*)?)\)\s*(?P<help>.*)$"
)
_TYPES = {"bool": bool, "int": int, "float": float, "str": str, "list": list}


@dataclass(frozen=True)
class Key:
    """One configuration key as declared in default.yaml: its type, the rules its value follows, and its help."""

    name: str
    default: Any
    types: tuple[type, ...]
    help: str
    choices: tuple[str, ...] = ()  # the strings it takes (all its values, for a key of type str alone)
    minimum: float | None = None
    exclusive: bool = False  # minimum itself not allowed (> rather than >=)
    maximum: float | None = None
    multiple_of: int | None = None

    @classmethod
    def parse(cls, name: str, default: Any, types: tuple[type, ...], rules: str, help: str) -> Key:
        fields: dict[str, Any] = {}
        for rule in filter(None, (r.strip() for r in rules.split(";"))):
            if rule.startswith("one of "):
                fields["choices"] = tuple(c.strip() for c in rule[len("one of ") :].split(","))
            elif rule.startswith("multiple of "):
                fields["multiple_of"] = int(rule[len("multiple of ") :])
            elif rule.startswith((">=", ">")):
                fields.update(minimum=float(rule.lstrip(">=")), exclusive=not rule.startswith(">="))
            elif " to " in rule:
                low, high = rule.split(" to ")
                fields.update(minimum=float(low), maximum=float(high))
            else:
                raise AssertionError(f"{DEFAULT_CFG}: {name}: unknown rule '{rule}'")
        return cls(name, default, types, help, **fields)


@cache
def schema() -> dict[str, Key]:
    """Parse default.yaml's keys, defaults and declared types."""
    keys = {}
    for n, line in enumerate(DEFAULT_CFG.read_text().splitlines(), 1):
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        assert m, f"{DEFAULT_CFG}:{n} does not read 'key: value # (types; rules) help'"
        types = tuple(_TYPES[t.strip()] for t in m["type"].split("|"))
        keys[m["key"]] = Key.parse(m["key"], yaml.safe_load(m["value"]), types, m["rules"], m["help"])
    return keys


def type_names(types: tuple[type, ...]) -> str:
    """The types as an error message names them: "an integer or text"."""
    names = {bool: "true/false", int: "an integer", float: "a number", str: "text", list: "a list"}
    return " or ".join(names[t] for t in types)


def typed_view() -> str:
    """keys.py's text: every key of default.yaml as a typed attribute of Keys."""
    names = {bool: "bool", int: "int", float: "float", str: "str", list: "list"}
    lines = []
    for k in schema().values():
        kind = " | ".join(names[t] for t in k.types) + (" | None" if k.default is None else "")
        lines.append(f"    {k.name}: {kind}")
    return KEYS_HEADER + "\n".join(lines) + "\n"


KEYS_HEADER = '''"""Generated from cfg/default.yaml by `python -m yoloaccum.config.schema`; do not edit. The
configuration's keys with their types, for type checkers and editors: a Config reads as Keys.
tests/test_config.py checks it is current."""

from __future__ import annotations


class Keys:
    __slots__ = ()

'''

if __name__ == "__main__":
    (Path(__file__).resolve().parent / "keys.py").write_text(typed_view())
