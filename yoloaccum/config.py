"""Load, merge and validate the configuration: cfg/default.yaml < a recipe (cfg=path.yaml) < key=value arguments.

cfg/default.yaml is the one source of truth for keys, defaults and types: each line reads `key: value # (type) help`.
The result is an immutable Config, saved beside the weights as args.yaml.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from yoloaccum.errors import UserError

_PACKAGE = Path(__file__).resolve().parent
# Source checkouts and editable installs keep cfg/ beside the package; wheels carry a copy inside it.
DEFAULT_CFG = next(
    (p for p in (_PACKAGE / "cfg/default.yaml", _PACKAGE.parent / "cfg/default.yaml") if p.exists()),
    _PACKAGE.parent / "cfg/default.yaml",
)
_LINE = re.compile(r"^(?P<key>[a-z_0-9]+):(?P<value>[^#]*)#\s*\((?P<type>[a-z |]+)\)\s*(?P<help>.*)$")
_TYPES = {"bool": bool, "int": int, "float": float, "str": str}

# Allowed values and lower bounds; the types come from default.yaml.
CHOICES = {
    "norm": ("window", "micro"),
    "bn": ("batch", "frozen", "sync", "window"),
    "remainder": ("step", "carry"),
    "mosaic_buffer": ("window", "batch"),
    "lr_scale": ("ultralytics", "linear", "sqrt", "none"),
    "split": ("val", "test"),
    "optimizer": ("auto", "SGD", "MuSGD", "Adam", "Adamax", "AdamW", "NAdam", "RAdam", "RMSprop"),
}
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # compile= a string
_ANY_CASE = {"optimizer"}  # Ultralytics matches these names in any case; the Config keeps the spelling above
_POSITIVE = {"epochs", "nbs", "imgsz", "clip_grad", "log_every", "max_det", "lrf", "ddp_timeout"}
_NON_NEGATIVE = {
    "lr0", "momentum", "weight_decay", "nan_patience", "warmup_epochs", "warmup_momentum", "warmup_bias_lr",
    "workers", "patience", "precise_bn", "bn_window", "close_mosaic", "box", "cls", "dfl", "seed", "hsv_h", "hsv_s",
    "hsv_v", "degrees", "translate", "scale", "shear", "perspective",
}  # fmt: skip
_PROBABILITIES = {"flipud", "fliplr", "bgr", "mosaic", "mixup", "cutmix", "fraction", "conf", "iou"}
_DERIVED = {
    "accumulate": "accumulate is derived as round(nbs / batch); set nbs to batch x N instead, e.g. nbs=64 with batch=8",
}


@dataclass(frozen=True)
class Key:
    """One configuration key as declared in default.yaml."""

    name: str
    default: Any
    types: tuple[type, ...]
    help: str


@cache
def schema() -> dict[str, Key]:
    """Parse default.yaml's keys, defaults and declared types."""
    keys = {}
    for n, line in enumerate(DEFAULT_CFG.read_text().splitlines(), 1):
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        assert m, f"{DEFAULT_CFG}:{n} does not read 'key: value # (type) help'"
        types = tuple(_TYPES[t.strip()] for t in m["type"].split("|"))
        keys[m["key"]] = Key(m["key"], yaml.safe_load(m["value"]), types, m["help"])
    return keys


@cache
def ultralytics_defaults() -> dict[str, Any]:
    """Ultralytics' own default.yaml, read without importing ultralytics (which would import torch)."""
    spec = importlib.util.find_spec("ultralytics")
    assert spec and spec.submodule_search_locations, "ultralytics is not installed"
    path = Path(spec.submodule_search_locations[0]) / "cfg/default.yaml"
    return yaml.safe_load(path.read_text())


class Config(Mapping[str, Any]):
    """The resolved, validated and immutable configuration of one run; read keys as attributes (cfg.batch)."""

    __slots__ = ("_values", "ignored")

    def __init__(self, values: Mapping[str, Any], ignored: Iterable[str] = ()):
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "ignored", tuple(ignored))  # Ultralytics keys in a recipe that yoloaccum ignores

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # not a key; also keeps copy and pickle from recursing before __init__
            raise AttributeError(name)
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Config is immutable; use cfg.replace(key=value)")

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Config({self._values!r})"

    def __reduce__(self):
        return Config, (dict(self._values), self.ignored)

    def replace(self, **changes: Any) -> Config:
        """A validated copy with some keys changed."""
        return Config(_validate({**self._values, **_check_keys(changes, "argument")}), self.ignored)

    def to_yaml(self) -> str:
        return yaml.safe_dump(dict(self._values), sort_keys=False)


def resolve(args: Iterable[str] = (), overrides: Mapping[str, Any] | None = None) -> Config:
    """Merge default.yaml, the recipe named by cfg=, and key=value arguments (later wins), then validate."""
    cli = parse_args(args)
    cli.update(overrides or {})
    values = {k.name: k.default for k in schema().values()}
    ignored: list[str] = []
    if recipe := cli.pop("cfg", None):
        recipe_values, ignored = load_recipe(recipe)
        values.update(recipe_values)
    values.update(_check_keys(cli, "argument"))
    return Config(_validate(values), ignored)


def parse_args(args: Iterable[str]) -> dict[str, Any]:
    """Turn ['batch=8', 'nbs=64'] into typed values; strings from the shell are converted by each key's type."""
    out: dict[str, Any] = {}
    for arg in args:
        key, sep, text = arg.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not sep or not key:
            raise UserError(f"'{arg}' is not key=value; write arguments like batch=8 nbs=64")
        out[key] = text if key == "cfg" else _from_text(key, text.strip())
    return out


def load_recipe(path: str | Path) -> tuple[dict[str, Any], list[str]]:
    """Read a recipe YAML; Ultralytics-only keys are dropped and listed if their value differs from its default."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"recipe file {path} does not exist; check the path given as cfg=")
    values = load_yaml(path)
    if not isinstance(values, dict):
        raise UserError(f"{path} must be a mapping of key: value lines")
    ours, ultra = schema(), ultralytics_defaults()
    # An empty value (`model:` in a copy of Ultralytics' default.yaml) means "not set", not "set to nothing".
    values = {k: v for k, v in values.items() if v is not None or k not in ours or ours[k].default is None}
    ignored = [k for k, v in values.items() if k not in ours and k in ultra and v != ultra[k] and k != "cfg"]
    kept = {k: v for k, v in values.items() if k in ours or k not in ultra}
    return _check_keys(kept, f"key in {path}"), ignored


def load_yaml(path: Path) -> Any:
    """yaml.safe_load that names the file and line of a syntax error."""
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        if mark is not None and mark.line >= len(path.read_text().rstrip("\n").splitlines()):
            mark = getattr(e, "context_mark", None) or mark  # hit the end of the file: name where the open item began
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise UserError(f"{where}: malformed YAML ({getattr(e, 'problem', None) or e}); fix the syntax there") from e


def _check_keys(values: Mapping[str, Any], what: str) -> dict[str, Any]:
    keys = schema()
    for k in values:
        if k in _DERIVED:
            raise UserError(_DERIVED[k])
        if k not in keys:
            if k in ultralytics_defaults():
                raise UserError(f"'{k}' is an Ultralytics setting that yoloaccum does not support; remove it")
            close = difflib.get_close_matches(k, keys, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else "; run 'yoloaccum cfg' to list the keys"
            raise UserError(f"unknown {what} '{k}'{hint}")
    return dict(values)


def _from_text(key: str, text: str) -> Any:
    """Convert a command-line string by the key's declared type; unknown keys pass through to be reported later."""
    spec = schema().get(key)
    if spec is None:
        return text
    if text in CHOICES.get(key, ()):  # a choice is itself, even one spelled like null (lr_scale=none)
        return text
    if text.lower() in {"", "none", "null"} and (spec.default is None or str in spec.types):
        return None
    for t in spec.types:
        if t is bool and text.lower() in {"true", "false"}:
            return text.lower() == "true"
        if t in (int, float):
            try:
                return t(text)
            except ValueError:
                continue
        if t is str:
            return text
    raise UserError(f"{key}={text} is not {_type_name(spec)}; e.g. {key}={spec.default}")


def _validate(values: dict[str, Any]) -> dict[str, Any]:
    keys = schema()
    for k, v in values.items():
        spec = keys[k]
        if k == "device" and isinstance(v, (int, list)) and not isinstance(v, bool):
            v = values[k] = ",".join(map(str, v)) if isinstance(v, list) else str(v)  # recipes write device: 0
        if v is None and spec.default is None:
            continue
        if isinstance(v, int) and not isinstance(v, bool) and float in spec.types and int not in spec.types:
            v = values[k] = float(v)
        if isinstance(v, float) and v.is_integer() and int in spec.types and (float not in spec.types or v >= 1):
            v = values[k] = int(v)  # as Ultralytics: epochs=1e2 is 100; batch=16.0 is 16 images
        if k in _ANY_CASE and isinstance(v, str):
            v = values[k] = next((c for c in CHOICES[k] if c.lower() == v.lower()), v)
        if isinstance(v, bool) and bool not in spec.types or not isinstance(v, spec.types):
            raise UserError(f"{k}={v!r} is not {_type_name(spec)}; e.g. {k}={spec.default}")
        if isinstance(v, float) and not math.isfinite(v):
            raise UserError(f"{k}={v} must be a finite number")
        _check_range(k, v)
    return values


def _check_range(k: str, v: Any) -> None:
    if k in CHOICES and v not in CHOICES[k]:
        raise UserError(f"{k}={v} is not one of {', '.join(CHOICES[k])}")
    if k == "precise_bn" and isinstance(v, str) and v != "auto":
        raise UserError(f"precise_bn={v} is not auto or a number of images (0 turns it off)")
    if k == "compile" and isinstance(v, str) and v not in COMPILE_MODES:
        raise UserError(f"compile={v} is not True, False or a mode: {', '.join(COMPILE_MODES)}")
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return
    if k == "batch":
        _check_batch(v)
    if k in _POSITIVE and v <= 0:
        raise UserError(f"{k}={v} must be greater than 0")
    if k in _NON_NEGATIVE and v < 0:
        raise UserError(f"{k}={v} must not be negative")
    if k in _PROBABILITIES and not 0 <= v <= 1:
        raise UserError(f"{k}={v} must be between 0 and 1")
    if k == "imgsz" and v % 32:
        raise UserError(
            f"imgsz={v} must be a multiple of 32, the largest model stride; e.g. imgsz={max(32, v // 32 * 32)}"
        )


def is_auto_batch(batch: int | float) -> bool:
    """Ultralytics' AutoBatch values: -1 (60% of CUDA memory) or a fraction of it."""
    return batch == -1 or 0 < batch < 1


def _check_batch(v: int | float) -> None:
    # AutoBatch values: train and plan choose the micro-batch from device memory (autobatch.py).
    if not is_auto_batch(v) and not (v >= 1 and float(v).is_integer()):
        raise UserError(
            f"batch={v} must be a whole number of images, e.g. batch=16, or -1 or a fraction such as 0.7 to choose "
            "it from CUDA memory"
        )


def _type_name(spec: Key) -> str:
    names = {bool: "true/false", int: "an integer", float: "a number", str: "text"}
    return " or ".join(names[t] for t in spec.types)
