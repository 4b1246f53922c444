"""Shared pytest set-up, the one place for fixtures that several test files use.

- A missing hard dependency or project package is an error at start-up, never a skipped test.
- Markers (pyproject.toml): ``gpu`` skips without CUDA; ``slow`` is the second command's set
  (``pytest -q -n 2 -m slow``): real train.py processes that the default set leaves out.
- tiktoken reads its offline cache; W&B runs offline. Tests that need files from the network (Tiny
  Shakespeare, tiktoken's GPT-2 BPE) skip with the reason without them.
- ``seed``: the seed of a test's random inputs. ``char_data``, ``tiny``: the char-level Tiny Shakespeare and
  the tiny run's overrides. ``reference_run``: the uninterrupted 16-step tiny run, trained once per session
  (shared by the xdist workers) for the tests that compare with it or copy it.
"""

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

# pyproject.toml's dependencies (import names) and the project's packages: found at start-up or the session
# stops, so no test can skip for want of one. find_spec imports nothing (triton must stay unimported until
# the kernel tests have chosen the interpreter).
HARD_DEPENDENCIES = ("torch", "triton", "numpy", "hydra", "wandb", "tiktoken", "matplotlib", "tqdm")
PROJECT_PACKAGES = ("kernels", "model", "data", "trainer", "bench")

# tiktoken's GPT-2 files: use the checkout's sibling shared/ cache unless the user set one.
if "TIKTOKEN_CACHE_DIR" not in os.environ and (SHARED / "tiktoken-cache").is_dir():
    os.environ["TIKTOKEN_CACHE_DIR"] = str(SHARED / "tiktoken-cache")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


def pytest_configure(config):
    missing = [m for m in HARD_DEPENDENCIES + PROJECT_PACKAGES if importlib.util.find_spec(m) is None]
    if missing:
        raise pytest.UsageError(
            f'missing: {", ".join(missing)}; install the project with `pip install -e ".[dev]"` '
            f"and run pytest from the repository root"
        )


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


#: Environment variable that replaces the fixed default seed of the ``seed`` fixture.
SEED_ENV = "FLASHGPT_TEST_SEED"


@pytest.fixture
def seed(request) -> int:
    """The seed of a test's random inputs: fixed, derived from the test's name (CRC-32, so tests draw
    different data) so a failure replays as it is, or ``$FLASHGPT_TEST_SEED`` to replay or vary it. Seeds
    torch's global generator too; printed (pytest shows it with a failure) with the replay command."""
    import zlib

    import torch

    raw = os.environ.get(SEED_ENV, str(zlib.crc32(request.node.name.encode())))
    try:
        s = int(raw)
    except ValueError:
        raise pytest.UsageError(f"{SEED_ENV}={raw!r} is not an integer; e.g. {SEED_ENV}=1234") from None
    print(f"seed={s} (replay: {SEED_ENV}={s} pytest ...; other inputs: another {SEED_ENV})")
    torch.manual_seed(s)
    return s


# ------------------------------------------------------------------------------------------ data


@pytest.fixture(scope="session")
def shakespeare_path() -> Path:
    """Local Tiny Shakespeare (../shared/data/tinyshakespeare.txt or $TINYSHAKESPEARE)."""
    p = Path(os.environ.get("TINYSHAKESPEARE", SHARED / "data" / "tinyshakespeare.txt"))
    if not p.is_file():
        pytest.skip(f"Tiny Shakespeare not found at {p}; set TINYSHAKESPEARE=PATH")
    return p


@pytest.fixture(scope="session")
def gpt2_bpe():
    """tiktoken's GPT-2 tokenizer; skips with the reason when its BPE files are neither in
    TIKTOKEN_CACHE_DIR nor downloadable (offline)."""
    from data.tokenizer import make_tokenizer

    try:
        return make_tokenizer("gpt2")
    except RuntimeError as e:
        cause = type(e.__cause__).__name__ if e.__cause__ else "error"
        cache = os.environ.get("TIKTOKEN_CACHE_DIR", "<unset>")
        pytest.skip(
            f"needs tiktoken's GPT-2 BPE files: none in TIKTOKEN_CACHE_DIR={cache}, and the "
            f"download failed ({cause}: offline?)"
        )


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory) -> Path:
    """A folder shared by every process of this pytest session: the xdist workers' common parent of their
    own temp dirs (the session's temp dir without xdist). Write there only under ``helpers_train.once``."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def char_data(session_dir, shakespeare_path) -> Path:
    """Tiny Shakespeare prepared with the char tokenizer, once per test session."""
    from tests.helpers_train import once, prepare_char_data

    with once(session_dir / "shakespeare_char"):  # every worker: ensure_prepared checks, under the lock
        return prepare_char_data(session_dir, shakespeare_path)


# ------------------------------------------------------------------------------------------ runs


@pytest.fixture(scope="session")
def tiny(char_data, shakespeare_path):
    """Factory: `helpers_train.tiny_overrides` bound to the shared char data: (out_dir, **extra) -> args.
    ``out_dir=None`` leaves ``out_dir`` out (Hydra's timestamped default, or a sweep's own dirs)."""
    from tests.helpers_train import tiny_overrides

    def make(out_dir: Path | None, **extra) -> list[str]:
        args = tiny_overrides(char_data, shakespeare_path, out_dir or Path("unused"), **extra)
        return [a for a in args if out_dir is not None or not a.startswith("out_dir=")]

    return make


def _train_once(out: Path, args: list[str], exit_code: int, status: str) -> Path:
    """``python train.py ARGS`` into ``out`` by the first worker that asks; every worker checks that it
    exited ``exit_code`` and left ``status`` in summary.json."""
    from tests.helpers_train import describe, once, run_train, summary

    with once(out) as first:
        if first:
            proc = run_train(args)
            assert proc.returncode == exit_code, describe(proc)
    got = summary(out).get("status") if (out / "summary.json").is_file() else None
    if got != status:
        pytest.fail(f"the shared run {out} has status {got}, not {status}: see its train.log")
    return out


@pytest.fixture(scope="session")
def reference_run(session_dir, tiny) -> Path:
    """The uninterrupted 16-step tiny run (naive attention, offline W&B): a real ``python train.py``
    process, trained once per session and shared by the workers. Read it, or copy it
    (``helpers_train.copy_run``) to resume or change it; never write into it."""
    out = session_dir / "reference_run"
    return _train_once(out, tiny(out, wandb__mode="offline", wandb__project="flashgpt-tests"), 0, "ok")


@pytest.fixture(scope="session")
def killed_run(session_dir, tiny) -> Path:
    """A 16-step tiny run (checkpoints every 4, offline W&B) SIGKILLed as update ``KILLED_AFTER + 1`` ends,
    before its log line: no ending ran, summary.json says "running" forever. Trained once per session and
    shared by the workers; copy it (``helpers_train.copy_run``) to read it with tools or resume it."""
    from tests.helpers_train import KILLED_AFTER

    out = session_dir / "killed_run"
    args = tiny(out, checkpoint__interval=4, wandb__mode="offline", fault__sigkill_at_step=KILLED_AFTER + 1)
    return _train_once(out, args, -9, "running")


# ------------------------------------------------------------------------------------ mounts (as root)
def _mount(args: list[str], what: str) -> None:
    """Run ``mount ARGS`` or skip (with the reason) where mounting is not allowed."""
    r = subprocess.run(["mount", *args], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot {what} here (needs root with CAP_SYS_ADMIN): {r.stderr.strip()}")


def _unmount(where: Path) -> None:
    subprocess.run(["umount", "--lazy", str(where)], check=False)  # a lingering wandb process may hold it


def _tmpfs(where: Path, options: str):
    where.mkdir(parents=True, exist_ok=True)
    _mount(["-t", "tmpfs", "-o", options, "tmpfs", str(where)], "mount a tmpfs")
    yield where
    _unmount(where)


@pytest.fixture
def small_disk(tmp_path):
    """An 8 MiB tmpfs (a real full disk): room for one checkpoint of the tiny model (~4.9 MiB), not two."""
    yield from _tmpfs(tmp_path / "disk", "size=8m")


@pytest.fixture
def read_only_dir(tmp_path):
    """An empty read-only tmpfs."""
    yield from _tmpfs(tmp_path / "ro", "ro,size=1m")


@pytest.fixture
def read_only_view(tmp_path):
    """Factory: ``make(src)`` is a read-only bind mount of folder ``src`` (a colleague's runs, a read-only
    share; as root, permission bits do not stop writes, a read-only mount does). Skips where refused."""
    views: list[Path] = []

    def make(src: Path) -> Path:
        view = tmp_path / f"ro_{src.name}"
        view.mkdir()
        _mount(["--bind", str(src), str(view)], "bind-mount")
        views.append(view)
        _mount(["-o", "remount,ro,bind", str(view)], "remount read-only")
        with pytest.raises(OSError):
            (view / "probe").write_text("x")
        return view

    yield make
    for view in reversed(views):
        _unmount(view)
