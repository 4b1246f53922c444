"""Shared pytest set-up: the `gpu` marker skips without CUDA; tiktoken reads its offline cache; tests that
need files from the network (Tiny Shakespeare, tiktoken's GPT-2 BPE) skip with the reason without them."""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

# tiktoken's GPT-2 files: use the checkout's sibling shared/ cache unless the user set one.
if "TIKTOKEN_CACHE_DIR" not in os.environ and (SHARED / "tiktoken-cache").is_dir():
    os.environ["TIKTOKEN_CACHE_DIR"] = str(SHARED / "tiktoken-cache")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing is a hard error elsewhere
        has_cuda = False
    if has_cuda:
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
def char_data(tmp_path_factory, shakespeare_path) -> Path:
    """Tiny Shakespeare prepared with the char tokenizer, once per test session."""
    from helpers_train import prepare_char_data

    return prepare_char_data(tmp_path_factory.getbasetemp(), shakespeare_path)


@pytest.fixture(scope="session")
def tiny(char_data, shakespeare_path):
    """Factory: `helpers_train.tiny_overrides` bound to the shared char data: (out_dir, **extra) -> args."""
    from helpers_train import tiny_overrides

    def make(out_dir: Path, **extra) -> list[str]:
        return tiny_overrides(char_data, shakespeare_path, out_dir, **extra)

    return make
