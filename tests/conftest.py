"""Shared test helpers: `run_cli` runs the real `yoloaccum` command line in a process of its own from the repository
root (forked from tests/cli_server.py, whose imports are done, or a fresh interpreter), with the network beyond this
machine blocked (tests/offline/sitecustomize.py); `cli_in_process` runs it in the test's own process, for error
paths; `shapes_yaml` makes small sets."""

import atexit
import contextlib
import importlib.util
import io
import json
import locale
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import cli_server
import pytest
import yaml
from filelock import FileLock

REPO = Path(__file__).resolve().parents[1]
OFFLINE = Path(__file__).resolve().parent / "offline"  # its sitecustomize blocks non-loopback connections
# Inherited settings that would change what the CLI prints: a debug traceback, or torchrun's world size.
_UNSET = ("YOLOACCUM_DEBUG", "WORLD_SIZE")

# Under pytest-xdist (`make test` runs a worker per core) each worker and every process it starts computes on one
# thread: a worker's two threads beside another worker's would contend for the same cores, and PyTorch's spinning
# threads then run several times slower. Set before anything imports torch; a user's own setting is kept.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def _block_the_network() -> None:
    """The guard the subprocesses load (tests/offline/sitecustomize.py), in the test process too: what runs in it,
    the in-process CLI included, downloads nothing either."""
    spec = importlib.util.spec_from_file_location("offline_guard", OFFLINE / "sitecustomize.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


_block_the_network()


# The files whose tests take longest, longest first (benchmarks/records/test-suite-times.md has their seconds). `make
# test` hands whole files to its workers in collection order (`--dist loadfile --no-loadscope-reorder`); started
# first, they leave the short files to fill the end, instead of one worker finishing a long file alone. Files not
# named follow in their usual order.
LONGEST_FIRST = (
    *("test_bench_smoke.py", "test_compile.py", "test_distributed.py", "test_validate_ddp.py", "test_resume.py"),
    "test_from_ultralytics.py",
    *("test_norm.py", "test_bad_input.py"),
    *("test_train.py", "test_validate.py", "test_parity.py", "test_backoff.py", "test_precise_bn.py"),
)


def pytest_collection_modifyitems(config, items) -> None:
    """The longest files first (LONGEST_FIRST). Tests marked cuda skip where torch sees no CUDA device (every CI
    machine here); on a GPU machine they run."""
    import torch

    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order
    for item in items:  # the gate's mark on each report, through xdist too (a keyword could be a parameter's id)
        if item.get_closest_marker("numerics"):
            item.user_properties.append(("numerics", True))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# Worst first: a test that passed its call but failed its teardown counts as an error.
_OUTCOMES = ("failed", "error", "xpassed", "skipped", "xfailed", "passed")


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """The numerics gate, named at the end of every session that ran its tests: how the exactness proofs (tests
    marked numerics) fared, apart from the rest. `make test` runs them in one session with everything else (two
    sessions built the files' shared fixtures twice); `make numerics` runs them alone. A test that crashed its
    xdist worker carries no mark: the gate then says it is incomplete."""
    worst: dict[str, str] = {}
    for outcome in reversed(_OUTCOMES):  # later, worse outcomes overwrite better ones
        for report in terminalreporter.stats.get(outcome, ()):
            if ("numerics", True) in getattr(report, "user_properties", ()):
                worst[report.nodeid] = outcome
    crashed = [r.nodeid for r in terminalreporter.stats.get("failed", ()) if getattr(r, "when", "") == "???"]
    if not worst:
        return
    counts = [f"{sum(o == outcome for o in worst.values())} {outcome}" for outcome in _OUTCOMES]
    broken = sorted(nodeid for nodeid, outcome in worst.items() if outcome in ("failed", "error", "xpassed"))
    verdict = "FAILED" if broken else "incomplete" if crashed else "passed"
    line = f"numerics gate {verdict}: " + ", ".join(c for c in counts if not c.startswith("0 "))
    if crashed:
        line += f", and {len(crashed)} crashed a worker"
    terminalreporter.write_sep("=", line, red=verdict != "passed", green=verdict == "passed", bold=True)
    for nodeid in broken + crashed:
        terminalreporter.write_line(f"  {nodeid}")


def offline_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The current environment without debug or torchrun settings, with the network guard on PYTHONPATH."""
    base = {k: v for k, v in os.environ.items() if k not in _UNSET}
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(OFFLINE), base.get("PYTHONPATH")]))
    return {**base, **(env or {})}


def _run_cli(
    *args: object, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """`python -m yoloaccum *args` with output captured; `env` adds to the current environment. The process is forked
    from the fork server (tests/cli_server.py), whose imports are done, unless `env` changes what a fresh interpreter
    would read while importing; then, or with YOLOACCUM_TESTS_FORK=0, it is a fresh interpreter."""
    cmd, full = [sys.executable, "-m", "yoloaccum", *map(str, args)], offline_env(env)
    server = _fork_server()
    if server is not None and server.forks(full):
        return server.run(cmd, full, cwd or REPO, timeout)
    return run_fresh(*args, env=env, cwd=cwd, timeout=timeout)


def run_fresh(
    *args: object, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """`python -m yoloaccum *args` in a fresh interpreter, whatever the fork server could do."""
    cmd = [sys.executable, "-m", "yoloaccum", *map(str, args)]
    return subprocess.run(cmd, cwd=cwd or REPO, env=offline_env(env), capture_output=True, text=True, timeout=timeout)


class _ForkServer:
    """The client of tests/cli_server.py: one server per test process, started at the first run_cli; a test process
    runs one test at a time, so one run at a time."""

    def __init__(self) -> None:
        # What importing yoloaccum sets in the environment (Ultralytics' offline switches) is set in this process
        # first, as the tests' own imports do: the server then starts with the environment run_cli passes on.
        import yoloaccum.config.ultra  # noqa: F401

        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (open while the server runs) its stderr, shown if it ends
        server = [sys.executable, str(Path(__file__).with_name("cli_server.py"))]
        self.environ = self._relevant(offline_env())
        pipe = subprocess.PIPE
        self.proc = subprocess.Popen(server, cwd=REPO, env=self.environ, stdin=pipe, stdout=pipe, stderr=self.log)
        self.buffer = b""
        self._reply(time.monotonic() + 120)  # ready

    def forks(self, env: dict[str, str]) -> bool:
        """Whether a child of the server is what a fresh interpreter with `env` would be: `env` is the environment
        the server started with, but for variables read only while running."""
        return not self.differences(env)

    def differences(self, env: dict[str, str]) -> dict[str, tuple[str | None, str | None]]:
        """The variables, read while importing, whose values in `env` and the server's environment differ."""
        mine = self._relevant(env)
        return {
            k: (mine.get(k), self.environ.get(k)) for k in {*mine, *self.environ} if mine.get(k) != self.environ.get(k)
        }

    @staticmethod
    def _relevant(env: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in env.items() if k not in cli_server.RUN_TIME}

    def run(self, cmd: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
            request = {"argv": cmd[3:], "env": env, "cwd": str(cwd), "out": str(out), "err": str(err)}
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
            try:
                pid = self._reply(None)["pid"]  # at once: the server only forks (or ends, which _reply says)
                status = self._reply(time.monotonic() + timeout)["status"]
            except subprocess.TimeoutExpired:
                os.kill(pid, signal.SIGKILL)
                self._reply(None)  # the killed child's status: the server is ready for the next run
                raise subprocess.TimeoutExpired(cmd, timeout, _text(out), _text(err)) from None
            except BaseException:  # Ctrl-C while waiting, say: a reply may be left unread, so end the server
                self.proc.kill()
                raise
            return subprocess.CompletedProcess(cmd, status, _text(out), _text(err))

    def _reply(self, deadline: float | None) -> dict:
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], wait)[0]:
                raise subprocess.TimeoutExpired(self.proc.args, wait)
            chunk = os.read(fd, 65536)
            if not chunk:
                self.log.seek(0)
                raise RuntimeError("the fork server ended:\n" + self.log.read().decode(errors="replace")[-3000:])
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a server that has ended has closed its end of the pipe
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _text(path: Path) -> str:
    """A file's text as subprocess.run(text=True) gives a pipe's: the locale's encoding, universal newlines."""
    return io.TextIOWrapper(io.BytesIO(path.read_bytes()), encoding=locale.getpreferredencoding(False)).read()


_SERVER: list[_ForkServer] = []


def _fork_server() -> _ForkServer | None:
    """This process' fork server, started again when it has ended (killed while a run was waited for) or when this
    process' own environment has changed since: a test's code may set a variable for good (inductor sets
    TORCHINDUCTOR_CACHE_DIR when it first compiles here), and runs started with it would otherwise all get fresh
    interpreters."""
    if os.environ.get("YOLOACCUM_TESTS_FORK") == "0":
        return None
    if _SERVER and (_SERVER[0].proc.poll() is not None or _SERVER[0].differences(offline_env())):
        _SERVER.pop().close()
    if not _SERVER:
        _SERVER.append(_ForkServer())
    return _SERVER[0]


@atexit.register
def _close_fork_server() -> None:
    if _SERVER:
        _SERVER.pop().close()


@pytest.fixture(scope="session")
def run_cli() -> Callable[..., subprocess.CompletedProcess]:
    return _run_cli


@pytest.fixture
def cli_in_process(monkeypatch, capsys) -> Callable[..., subprocess.CompletedProcess]:
    """`yoloaccum *args` run as run_cli runs it, the entry point included, but in this process: for error paths, which
    end before anything trains, without a fresh interpreter's 3 to 4 s of imports each. The global settings a run
    makes on its way (deterministic kernels, the environment) are put back; a traceback raises here as it would exit
    there. Each exit code also keeps a test through a real subprocess."""
    from yoloaccum import cli

    def run(*args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        monkeypatch.chdir(REPO)
        for key in _UNSET:
            monkeypatch.delenv(key, raising=False)
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        monkeypatch.setattr(sys, "argv", ["yoloaccum", *map(str, args)])
        capsys.readouterr()
        try:
            cli.run()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    with global_settings_kept():
        yield run


@pytest.fixture
def settings_kept() -> Iterator[None]:
    """For tests that build or run a run in this process: its global settings put back afterwards."""
    with global_settings_kept():
        yield


@contextlib.contextmanager
def global_settings_kept() -> Iterator[None]:
    """Put back, on the way out, the process-wide settings a run makes (global_settings.kept(): deterministic kernels,
    cuDNN's modes, the random states, the environment...), for tests that run a run's code in this process other than
    through the API, which keeps them itself: the trainer's parts, seed_everything, Ultralytics' own trainer. torch is
    imported first: kept() keeps torch's settings only where torch is imported."""
    import torch  # noqa: F401

    from yoloaccum.process.global_settings import kept

    with kept():
        yield


def shapes_yaml(folder: Path, num_train: int, num_val: int, imgsz: int = 64, seed: int = 3) -> Path:
    """A small shapes set (generated on first use by yoloaccum), with an absolute root so Ultralytics finds it too."""
    spec = {
        "path": str(folder / "shapes"),
        "train": "images/train",
        "val": "images/val",
        "names": {0: "circle", 1: "square", 2: "triangle", 3: "cross"},
        "yoloaccum_generate": {"num_train": num_train, "num_val": num_val, "imgsz": imgsz, "seed": seed},
    }
    path = folder / "shapes.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


# Runs that test the run's plumbing (resume, signals, faults, ranks), not what a model learns or how Ultralytics
# draws it: tests/models/tiny26.yaml (a YOLO26 cut down, of real Ultralytics modules) and no plots. A 4-epoch run of
# 24 images at 64 px, one thread: 17.9 s with yolo26n and plots, 10.8 s without plots, 7.2 s on tiny26 without.
TINY_MODEL = str(REPO / "tests/models/tiny26.yaml")
PLUMBING = (f"model={TINY_MODEL}", "plots=False")

# Runs compared bitwise across processes use one thread: with two, some of PyTorch's CPU kernels split their work
# by timing, and two identical runs can end apart (measured: 1.4e-2 relative after 4 epochs).
SERIAL = {"OMP_NUM_THREADS": "1"}

# The exactness runs: yolo26n, no warmup, BatchNorm frozen, augmentation off, workers=0; 42 images, so each epoch
# ends in a short window. They start from briefly trained weights: a head fresh from initialisation predicts boxes
# exactly on the pixel grid, where CIoU's min/max meet ties and float32 noise of 1e-7 picks the subgradient (a 1e-2
# change in a few biases). Shared by the single-process and the torchrun comparisons.
EXACT = (
    "model=yolo26n.yaml",
    "imgsz=64",
    "epochs=2",
    "warmup_epochs=0",
    "bn=frozen",
    "workers=0",
    "seed=0",
    "deterministic=True",
    "mosaic=0",
    "fliplr=0",
    "hsv_h=0",
    "hsv_s=0",
    "hsv_v=0",
    "scale=0",
    "translate=0",
    "val=False",
    "plots=False",
    "exist_ok=True",
)


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], object]) -> object:
    """A session fixture's value, made once for the whole test run: `make(folder)` returns something JSON can hold.
    Under pytest-xdist every worker has a session of its own, so the first worker to ask makes it in a folder all
    workers see, and the others wait for it there and read what it returned."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' basetemps are siblings
    folder, done = root / name, root / f"{name}.json"
    with FileLock(root / f"{name}.lock"):
        if not done.exists():
            folder.mkdir(exist_ok=True)
            done.write_text(json.dumps(make(folder)))
    return json.loads(done.read_text())


@pytest.fixture(scope="session")
def exact_args(tmp_path_factory) -> tuple[str, ...]:
    """The shared arguments: the data, EXACT, and a start from one epoch of training."""

    def make(folder: Path) -> list[str]:
        data = shapes_yaml(folder, num_train=42, num_val=8, seed=5)
        # precise_bn=0 here: the runs freeze BatchNorm at the start's statistics, and recomputed ones (from one pass
        # in which upstream layers normalise per batch) leave activations for which float32 reordering grows past
        # the tolerance within six steps. The compared runs keep the default, which touches only the EMA.
        r = _run_cli(
            "train",
            f"data={data}",
            f"project={folder}",
            "name=start",
            *EXACT,
            "epochs=1",
            "batch=16",
            "nbs=16",
            "precise_bn=0",
            env=SERIAL,
            timeout=600,
        )
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        return [f"data={data}", *EXACT, f"pretrained={folder / 'start/weights/last.pt'}"]

    return tuple(made_once(tmp_path_factory, "exact", make))


@pytest.fixture(scope="session")
def big_batch_run(exact_args, tmp_path_factory) -> Path:
    """The reference: one process, batch=16 nbs=16 (no accumulation)."""

    def make(project: Path) -> str:
        r = _run_cli(
            "train", f"project={project}", "name=big", *exact_args, "batch=16", "nbs=16", env=SERIAL, timeout=600
        )
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        return str(project / "big")

    return Path(made_once(tmp_path_factory, "big", make))


def final_weights(run: Path):
    """The fp32 weights in a run's last.pt, as one flat tensor."""
    import torch

    ckpt = torch.load(run / "weights/last.pt", map_location="cpu", weights_only=False)
    state = ckpt["yoloaccum"]["model"]
    return torch.cat([v.flatten().float() for v in state.values() if v.is_floating_point()])


def relative_difference(a, b) -> float:
    """max|a - b| / max|b|."""
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """A model that has learned something, so that compared metrics are not all zero: yolo11n, 6 epochs of 160 shapes
    images at 96 px; its best.pt and dataset (32 validation images). Made once for the whole test run."""

    def make(folder: Path) -> list[str]:
        dataset = shapes_yaml(folder, num_train=160, num_val=32, imgsz=96, seed=11)
        r = _run_cli(
            "train",
            f"data={dataset}",
            "model=yolo11n.yaml",
            "imgsz=96",
            "batch=8",
            "nbs=8",
            "epochs=6",
            "mosaic=0",
            "warmup_epochs=1",
            "close_mosaic=0",
            "workers=0",
            "val=False",
            f"project={folder}",
            "name=val",
            timeout=900,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        return [str(folder / "val/weights/best.pt"), str(dataset)]

    weights, dataset = made_once(tmp_path_factory, "trained", make)
    return Path(weights), Path(dataset)
