"""Unit tests for yoloaccum.config.settings: precedence, typing, validation, immutability and Ultralytics recipes."""

import re
from pathlib import Path

import pytest
import yaml

from yoloaccum.config import settings as config
from yoloaccum.errors import UserError


def _recipe(tmp_path: Path, text: str, name: str = "recipe.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return f"cfg={path}"


def test_defaults_are_default_yaml() -> None:
    cfg = config.resolve([])
    assert dict(cfg) == {k.name: k.default for k in config.schema().values()}
    assert cfg.ignored == ()


def test_precedence_default_then_recipe_then_command_line(tmp_path: Path) -> None:
    cfg = config.resolve([_recipe(tmp_path, "batch: 8\nnbs: 128\n"), "batch=4"])
    assert (cfg.batch, cfg.nbs) == (4, 128)  # command line beats the recipe, which beats default.yaml
    assert cfg.epochs == config.schema()["epochs"].default


def test_command_line_wins_wherever_cfg_appears(tmp_path: Path) -> None:
    assert config.resolve(["batch=4", _recipe(tmp_path, "batch: 8\n")]).batch == 4


@pytest.mark.parametrize(
    ("arg", "key", "expected"),
    [
        ("batch=8", "batch", 8),
        ("lr0=1", "lr0", 1.0),
        ("amp=false", "amp", False),
        ("amp=True", "amp", True),
        ("device=", "device", None),
        ("device=0", "device", "0"),
        ("device=0,1", "device", "0,1"),
        ("pretrained=path.pt", "pretrained", "path.pt"),
        ("pretrained=False", "pretrained", False),
        ("cache=ram", "cache", "ram"),
        ("conf=", "conf", None),
    ],
)
def test_command_line_values_are_typed(arg: str, key: str, expected: object) -> None:
    value = config.resolve([arg])[key]
    assert value == expected
    assert type(value) is type(expected)


def test_yaml_int_becomes_float_for_a_float_key(tmp_path: Path) -> None:
    cfg = config.resolve([_recipe(tmp_path, "lr0: 1\nwarmup_epochs: 3\n")])
    assert (cfg.lr0, cfg.warmup_epochs) == (1.0, 3.0)
    assert type(cfg.lr0) is float and type(cfg.warmup_epochs) is float


def test_recipe_device_number_is_text(tmp_path: Path) -> None:
    assert config.resolve([_recipe(tmp_path, "device: 0\n")]).device == "0"


def test_config_is_immutable() -> None:
    cfg = config.resolve([])
    with pytest.raises(AttributeError, match="immutable"):
        cfg.batch = 4
    with pytest.raises(TypeError):
        cfg["batch"] = 4  # type: ignore[index]
    assert cfg.batch == 16


def test_replace_returns_a_validated_copy() -> None:
    cfg = config.resolve([])
    smaller = cfg.replace(batch=4)
    assert (smaller.batch, cfg.batch) == (4, 16)
    with pytest.raises(UserError, match="batch=0 must be a whole number of images"):
        cfg.replace(batch=0)
    with pytest.raises(UserError, match="did you mean 'batch'"):
        cfg.replace(bacth=4)
    with pytest.raises(UserError, match="nbs"):
        cfg.replace(accumulate=4)


@pytest.mark.parametrize(
    ("given", "canonical"),
    [("sgd", "SGD"), ("adamw", "AdamW"), ("RMSProp", "RMSprop"), ("musgd", "MuSGD"), ("AUTO", "auto")],
)
def test_optimizer_names_match_in_any_case_as_in_ultralytics(tmp_path: Path, given: str, canonical: str) -> None:
    assert config.resolve([f"optimizer={given}"]).optimizer == canonical
    assert config.resolve([_recipe(tmp_path, f"optimizer: {given}\n")]).optimizer == canonical


@pytest.mark.parametrize(("given", "value"), [("-1", -1), ("0.7", 0.7), ("16.0", 16), ("1e1", 10)])
def test_batch_accepts_what_ultralytics_accepts(given: str, value: float) -> None:
    assert config.resolve([f"batch={given}"]).batch == value


@pytest.mark.parametrize("given", ["2.5", "-3", "0", "1.5"])
def test_batch_out_of_range_says_what_to_give(given: str) -> None:
    with pytest.raises(UserError, match=rf"batch={given} must be a whole number of images, e.g. batch=16"):
        config.resolve([f"batch={given}"])


def test_imgsz_must_be_a_multiple_of_32() -> None:
    with pytest.raises(UserError, match="multiple of 32.*imgsz=96"):
        config.resolve(["imgsz=100"])


def test_choices_are_enforced() -> None:
    with pytest.raises(UserError, match="norm=bogus is not one of window, micro"):
        config.resolve(["norm=bogus"])


def test_argument_without_equals_sign() -> None:
    with pytest.raises(UserError, match="not key=value"):
        config.resolve(["batch"])


def test_unknown_key_in_a_recipe_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"recipe\.yaml 'bacth'; did you mean 'batch'"):
        config.resolve([_recipe(tmp_path, "bacth: 8\n")])


def test_to_yaml_round_trips() -> None:
    cfg = config.resolve(["batch=8", "device=0"])
    assert yaml.safe_load(cfg.to_yaml()) == dict(cfg)


ULTRALYTICS_AT_DEFAULTS = "overlap_mask: True\nprofile: False\nbatch: 8\nnbs: 64\n"


def test_unsupported_keys_at_ultralytics_defaults_are_dropped_silently(tmp_path: Path) -> None:
    cfg = config.resolve([_recipe(tmp_path, ULTRALYTICS_AT_DEFAULTS)])
    assert cfg.ignored == ()
    assert dict(cfg) == dict(config.resolve(["batch=8"]))
    assert "overlap_mask" not in cfg and "profile" not in cfg


def test_dropped_keys_are_listed_with_their_reason(tmp_path: Path) -> None:
    recipe = (
        ULTRALYTICS_AT_DEFAULTS + "profile: True\nmode: val\ntask: detect\nsave_dir: runs/detect/train\nhalf: True\n"
    )
    cfg = config.resolve([_recipe(tmp_path, recipe)])
    assert cfg.ignored[0] == "mode, task, save_dir (they describe a run, not a recipe)"
    assert any(x.startswith("profile (ONNX and TensorRT profiling") for x in cfg.ignored)
    assert any(x.startswith("half (export and predict precision") for x in cfg.ignored)
    assert cfg.batch == 8
    note = config.dropped_note(cfg)
    assert note and "\n" not in note and "save_dir" in note and "half" in note


# Every key of Ultralytics' default.yaml is used with Ultralytics' meaning, or has its reason in ultralytics_keys.
USED_AS_ULTRALYTICS = (
    "model",
    "data",
    "epochs",
    "time",
    "patience",
    "batch",
    "imgsz",
    "save",
    "save_period",
    "cache",
    "device",
    "workers",
    "project",
    "name",
    "exist_ok",
    "pretrained",
    "optimizer",
    "verbose",
    "seed",
    "deterministic",
    "single_cls",
    "classes",
    "rect",
    "multi_scale",
    "freeze",
    "cls_remap",
    "cos_lr",
    "close_mosaic",
    "resume",
    "amp",
    "fraction",
    "channels_last",
    "val",
    "split",
    "conf",
    "iou",
    "max_det",
    "plots",
    "source",
    "lr0",
    "lrf",
    "momentum",
    "weight_decay",
    "warmup_epochs",
    "warmup_momentum",
    "warmup_bias_lr",
    "box",
    "cls",
    "dfl",
    "nbs",
    "hsv_h",
    "hsv_s",
    "hsv_v",
    "degrees",
    "translate",
    "scale",
    "shear",
    "perspective",
    "flipud",
    "fliplr",
    "bgr",
    "mosaic",
    "mixup",
    "cutmix",
    "compile",
)


def test_ultralytics_default_yaml_loads_as_a_recipe(tmp_path: Path) -> None:
    """Every key at its default is accepted; each is ours, with Ultralytics' meaning, or has a reason it is not."""
    from yoloaccum.config import ultralytics_keys

    ultra = config.ultralytics_defaults()
    not_ours = [k for k in ultra if k not in USED_AS_ULTRALYTICS]
    assert all(ultralytics_keys.reason(k) for k in not_ours), [k for k in not_ours if not ultralytics_keys.reason(k)]
    assert set(USED_AS_ULTRALYTICS) <= set(config.schema()), "a key listed as used is not in cfg/default.yaml"
    cfg = config.resolve([_recipe(tmp_path, yaml.safe_dump(ultra))])
    assert len(cfg.ignored) == 1 and cfg.ignored[0].endswith(" (they describe a run, not a recipe)")
    assert set(cfg.ignored[0].split(" (")[0].split(", ")) == {"task", "mode"}
    ours = config.schema()
    for k in USED_AS_ULTRALYTICS:
        # An empty value (model:, channels_last:) means "not set": our default stands.
        assert cfg[k] == (ultra[k] if ultra[k] is not None else ours[k].default), k
    changed = {**ultra, **{k: "changed" for k in not_ours}}
    dropped = config.resolve([_recipe(tmp_path, yaml.safe_dump(changed))]).ignored
    listed = {k for x in dropped[1:] for k in x.split(" (")[0].split(", ")}
    assert listed == set(not_ours) - set(ultralytics_keys.RUN_KEYS)


def test_keys_py_is_the_typed_view_of_default_yaml() -> None:
    """keys.py is generated from default.yaml: a key added, removed or retyped there without regenerating it fails
    here (run `python -m yoloaccum.config.schema`)."""
    from yoloaccum.config import schema

    assert (Path(schema.__file__).parent / "keys.py").read_text() == schema.typed_view()


def test_every_cfg_attribute_the_code_reads_is_a_key() -> None:
    """`cfg.anything` fails where it is written, not on the line of a run that reaches it: every `cfg.<name>` in the
    package and the benchmarks names a key or a Config method."""
    import re

    root = Path(config.__file__).parents[1]
    allowed = set(config.schema()) | {n for n in dir(config.Config) if not n.startswith("_")} | {"ignored"}
    unknown = [
        f"{path.relative_to(root)}:{n}: cfg.{name}"
        for path in [*root.glob("yoloaccum/*.py"), *root.glob("benchmarks/*.py")]
        for n, line in enumerate(path.read_text().splitlines(), 1)
        for name in re.findall(r"\bcfg\.([a-z_0-9]+)", line)
        if name not in allowed
    ]
    assert not unknown, unknown
    with pytest.raises(AttributeError, match="Config has no key 'nsb'; did you mean 'nbs'"):
        config.resolve([]).nsb  # noqa: B018


@pytest.mark.parametrize(
    "arg, message",
    [
        ("fraction=1.5", "fraction=1.5 must be greater than 0 and at most 1"),
        ("fraction=-0.1", "fraction=-0.1 must be greater than 0 and at most 1"),
        ("fraction=0", "fraction=0.0 must be greater than 0 and at most 1"),  # Ultralytics refuses it
        ("momentum=1.5", "momentum=1.5 must be between 0 and 1"),
        ("clip_grad=0", "clip_grad=0.0 must be greater than 0"),
        ("workers=-1", "workers=-1 must not be negative"),
        ("imgsz=100", "imgsz=100 must be a multiple of 32; e.g. imgsz=96"),
        ("mosaic_buffer=all", "mosaic_buffer=all is not one of window, batch"),
        ("precise_bn=-1", "precise_bn=-1 must not be negative"),
        ("compile=fast", "compile=fast is not true/false or one of default, reduce-overhead"),
    ],
)
def test_each_rule_of_default_yaml_is_enforced_with_its_message(arg, message) -> None:
    with pytest.raises(UserError, match=re.escape(message)):
        config.resolve([arg])


def test_the_rules_parse_from_their_declaration() -> None:
    key = config.Key.parse("k", 1, (int, str), "; >= 0; one of auto, all", "help")
    assert (key.minimum, key.exclusive, key.maximum, key.choices) == (0, False, None, ("auto", "all"))
    assert config.Key.parse("p", 0.5, (float,), "; 0 to 1", "").maximum == 1
    assert config.Key.parse("n", 1, (int,), "; > 0; multiple of 8", "").multiple_of == 8
    with pytest.raises(AssertionError, match="unknown rule 'below 3'"):
        config.Key.parse("x", 1, (int,), "; below 3", "")
