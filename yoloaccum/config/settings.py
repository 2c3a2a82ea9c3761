"""Load, merge and validate the configuration: cfg/default.yaml < a recipe (cfg=path.yaml) < key=value arguments.

cfg/default.yaml is the one source of truth for each key's default, type, allowed values and help (schema.py reads
it). The result is an immutable Config, typed by keys.py, saved beside the weights as args.yaml.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
from collections.abc import Iterable, Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from yoloaccum.config.keys import Keys
from yoloaccum.config.schema import Key, schema, type_names
from yoloaccum.config.ultralytics_keys import RUN_KEYS, UNSUPPORTED
from yoloaccum.config.ultralytics_keys import reason as unsupported_reason
from yoloaccum.errors import UserError

_ANY_CASE = {"optimizer"}  # Ultralytics matches these names in any case; the Config keeps default.yaml's spelling
_DERIVED = {
    "accumulate": "accumulate is derived as round(nbs / batch); set nbs to batch x N instead, e.g. nbs=64 with batch=8",
}
# A value to show in a message for the keys whose default is empty, where `e.g. freeze=None` would show nothing.
_EXAMPLES = {
    "data": "datasets/shapes.yaml",
    "freeze": "10",
    "time": "1.5",
    "device": "0",
    "classes": "[0, 2]",
    "project": "runs/train",
    "name": "exp",
    "conf": "0.25",
    "source": "images/",
}


@cache
def ultralytics_defaults() -> dict[str, Any]:
    """Ultralytics' own default.yaml, read without importing ultralytics (which would import torch)."""
    spec = importlib.util.find_spec("ultralytics")
    assert spec and spec.submodule_search_locations, "ultralytics is not installed"
    path = Path(spec.submodule_search_locations[0]) / "cfg/default.yaml"
    return yaml.safe_load(path.read_text())


class Config(Mapping[str, Any], Keys):
    """The resolved, validated and immutable configuration of one run; read keys as attributes (cfg.batch), typed by
    Keys for type checkers and editors, which see no __getattr__: an unknown key is flagged where it is written."""

    __slots__ = ("_values", "ignored")

    def __init__(self, values: Mapping[str, Any], ignored: Iterable[str] = ()):
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "ignored", tuple(ignored))  # a recipe's keys that were dropped, as "key (why)"

    if not TYPE_CHECKING:

        def __getattr__(self, name: str) -> Any:
            if name.startswith("_"):  # not a key; also keeps copy and pickle from recursing before __init__
                raise AttributeError(name)
            try:
                return self._values[name]
            except KeyError:
                close = difflib.get_close_matches(name, self._values, n=1)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise AttributeError(f"Config has no key '{name}'{hint}") from None

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

    @property
    def from_weights(self) -> bool:
        """Whether the run starts from trained weights (fine-tunes): a .pt model, unless pretrained=False, or a
        pretrained= path; a YAML model alone trains from scratch."""
        return isinstance(self.pretrained, str) or (str(self.model).endswith(".pt") and self.pretrained is not False)

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


def yamls_in(folder: Path) -> str:
    """ " (it holds a.yaml, b.yaml)": for the line that refuses a folder given where a YAML file is meant."""
    found = sorted(p.name for p in folder.glob("*.y*ml"))
    return f" (it holds {', '.join(found[:3])})" if found else ""


def load_recipe(path: str | Path) -> tuple[dict[str, Any], list[str]]:
    """Read a recipe YAML, an Ultralytics run's args.yaml included. Keys yoloaccum does not take are dropped: those
    that describe a run (save_dir, mode, ...) or were retired by Ultralytics (half, ...) are listed, and so are
    unsupported ones whose value differs from Ultralytics' default (at the default they change nothing)."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"cfg={path} is a folder{yamls_in(path)}; give a recipe YAML file")
    if not path.is_file():
        raise UserError(f"recipe file {path} does not exist; check the path given as cfg=")
    values = load_yaml(path)
    if not isinstance(values, dict):
        raise UserError(f"{path} must be a mapping of key: value lines")
    if "names" in values and ("train" in values or "val" in values):
        raise UserError(f"{path} is a dataset YAML (train, val, names), not a recipe; give it as data={path}")
    ours, ultra = schema(), ultralytics_defaults()
    # An empty value (`model:` in a copy of Ultralytics' default.yaml) means "not set", not "set to nothing".
    values = {k: v for k, v in values.items() if v is not None or k not in ours or ours[k].default is None}
    dropped = {k: v for k, v in values.items() if k not in ours and unsupported_reason(k)}
    listed = [k for k, v in dropped.items() if k != "cfg" and (k not in UNSUPPORTED or v != ultra.get(k))]
    by_reason: dict[str, list[str]] = {}
    for k in listed:
        reason = "they describe a run, not a recipe" if k in RUN_KEYS else unsupported_reason(k)
        by_reason.setdefault(reason, []).append(k)
    run_first = sorted(by_reason.items(), key=lambda item: item[1][0] not in RUN_KEYS)
    ignored = [f"{', '.join(keys)} ({reason})" for reason, keys in run_first]
    kept = {k: v for k, v in values.items() if k not in dropped}
    return _check_keys(kept, f"key in {path}"), ignored


def dropped_note(cfg: Config) -> str | None:
    """The one line that lists what a recipe's dropped keys were, or None."""
    if not cfg.ignored:
        return None
    return f"the recipe's keys that yoloaccum does not take were dropped: {'; '.join(cfg.ignored)}"


def load_yaml(path: Path) -> Any:
    """yaml.safe_load that names the file and line of a syntax error."""
    try:
        return yaml.safe_load(path.read_text())
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not a text file (byte {e.start} is not UTF-8); give a YAML file") from e
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
            if why := unsupported_reason(k):
                raise UserError(f"'{k}' is an Ultralytics setting that yoloaccum does not take: {why}; remove it")
            close = difflib.get_close_matches(k, keys, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else "; run 'yoloaccum cfg' to list the keys"
            raise UserError(f"unknown {what} '{k}'{hint}")
    return dict(values)


def _from_text(key: str, text: str) -> Any:
    """Convert a command-line string by the key's declared type; unknown keys pass through to be reported later."""
    spec = schema().get(key)
    if spec is None:
        return text
    if choice := next((c for c in spec.choices if c.lower() == text.lower()), None):
        return choice  # a choice is itself, in any case, even one spelled like null (lr_scale=none, lr_scale=None)
    if text.lower() in {"", "none", "null"} and (spec.default is None or str in spec.types):
        return None
    for t in spec.types:
        if t is bool and text.lower() in {"true", "false"}:
            return text.lower() == "true"
        if t is list and text.startswith("["):
            return _list_from_text(key, text)
        if t in (int, float):
            try:
                return t(text)
            except ValueError:
                if t is int and _integral(text):  # as Ultralytics: epochs=1e2 is 100
                    return int(float(text))
                continue
        if t is list and "," in text:  # freeze=0,1,2 as freeze=[0,1,2]
            return _list_from_text(key, f"[{text}]")
        if t is str:
            return text
    raise UserError(f"{key}={text} is not {type_names(spec.types)}; e.g. {_example(spec)}")


def _example(spec: Key) -> str:
    """key=value with a value the key takes: its default, or where that is empty, _EXAMPLES' value."""
    return f"{spec.name}={spec.default if spec.default is not None else _EXAMPLES[spec.name]}"


def _integral(text: str) -> bool:
    try:
        return float(text).is_integer()
    except ValueError:
        return False


def _list_from_text(key: str, text: str) -> list:
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = None
    if not isinstance(value, list):
        raise UserError(f"{key}={text} is not a list; write it as {key}=[0,1,2]")
    return value


def _validate(values: dict[str, Any]) -> dict[str, Any]:
    keys = schema()
    for k, v in values.items():
        spec = keys[k]
        if k == "device" and isinstance(v, (int, list)) and not isinstance(v, bool):
            v = values[k] = ",".join(map(str, v)) if isinstance(v, list) else str(v)  # recipes write device: 0
        if v is None and spec.default is None:
            continue
        if k == "multi_scale" and isinstance(v, bool):  # Ultralytics before 8.4: a switch for +/- 50%
            v = values[k] = 0.5 if v else 0.0
        if v is None:
            raise UserError(f"{k} needs a value: {_what_it_takes(spec)}; e.g. {_example(spec)}")
        if isinstance(v, int) and not isinstance(v, bool) and float in spec.types and int not in spec.types:
            v = values[k] = float(v)
        if isinstance(v, float) and v.is_integer() and int in spec.types and (float not in spec.types or v >= 1):
            v = values[k] = int(v)  # as Ultralytics: epochs=1e2 is 100; batch=16.0 is 16 images
        if k in _ANY_CASE and isinstance(v, str):
            v = values[k] = next((c for c in spec.choices if c.lower() == v.lower()), v)
        if isinstance(v, bool) and bool not in spec.types or not isinstance(v, spec.types):
            raise UserError(f"{k}={v!r} is not {type_names(spec.types)}; e.g. {_example(spec)}")
        if isinstance(v, float) and not math.isfinite(v):
            raise UserError(f"{k}={v} must be a finite number")
        if isinstance(v, list):
            _check_list(k, v)
        _check_rules(spec, v)
    return values


def _what_it_takes(spec: Key) -> str:
    others = [type_names(tuple(t for t in spec.types if t is not str))] * (spec.types != (str,))
    return " or ".join([*others, *(["one of " + ", ".join(spec.choices)] if spec.choices else [])]) or type_names(
        spec.types
    )


def _check_list(key: str, value: list) -> None:
    """freeze lists layer indices or module names; classes lists class ids, at least one (Ultralytics keeps no box for
    an empty list)."""
    if key == "classes" and not value:
        raise UserError("classes=[] keeps no class: list the class ids to train on, e.g. classes=[0, 2], or drop it")
    kinds = (int, str) if key == "freeze" else (int,)
    if not all(isinstance(x, kinds) and not isinstance(x, bool) for x in value):
        what, example = (
            ("layer indices or module names", '[0, 1, 2] or ["23.cv2"]') if key == "freeze" else ("class ids", "[0, 2]")
        )
        raise UserError(f"{key}={value} must list {what}, e.g. {key}={example}")


def _check_rules(spec: Key, v: Any) -> None:
    """The rules default.yaml gives the key; batch's own (AutoBatch values) in _check_batch."""
    k = spec.name
    if isinstance(v, str) and spec.choices and v not in spec.choices:
        raise UserError(f"{k}={v} is not {_what_it_takes(spec)}")
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return
    if k == "batch":
        _check_batch(v)
    low = spec.minimum is None or (v > spec.minimum if spec.exclusive else v >= spec.minimum)
    if spec.maximum is not None and not (low and v <= spec.maximum):
        above = f"greater than {spec.minimum:g} and at most" if spec.exclusive else f"between {spec.minimum:g} and"
        raise UserError(f"{k}={v} must be {above} {spec.maximum:g}")
    if not low:
        bound = f"greater than {spec.minimum:g}" if spec.exclusive else f"at least {spec.minimum:g}"
        raise UserError(f"{k}={v} must {'not be negative' if bound == 'at least 0' else 'be ' + bound}")
    if spec.multiple_of and v % spec.multiple_of:
        e = max(spec.multiple_of, v // spec.multiple_of * spec.multiple_of)
        raise UserError(f"{k}={v} must be a multiple of {spec.multiple_of}; e.g. {k}={e}")


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
