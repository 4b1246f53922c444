"""Shared by sample.py and eval.py: find a run's checkpoint, rebuild its model. A user error raises
``InferError`` (the entry points print it and exit 2, writing nothing)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from pathlib import Path

import torch

from trainer import checkpoint as ckpt
from trainer.fields import step_span
from trainer.resume_config import anchored, run_cwd
from trainer.rundir import KILLED, is_run_dir, read_summary, true_status

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class InferError(Exception):
    """A user error of sample.py / eval.py, naming the key and what to do (``error: ...``, exit 2)."""


def find_checkpoint(run: str | None, ckpt_path: str | None, warn=print) -> tuple[Path, dict, Path]:
    """(path, record, run directory) of ``ckpt_path`` (a checkpoint directory or a file in it, of the run
    ``run`` when given too), else of the newest checkpoint of ``run`` that loads."""
    if ckpt_path:
        p = _checkpoint_dir(ckpt_path)
        run_dir = p.parent.parent if p.parent.name == ckpt.CKPT_DIR_NAME else p.parent
        if run and run_dir.resolve() != Path(run).resolve():  # its results would go to run, not run_dir
            alone = f", or run={run} alone (its newest checkpoint)" if is_run_dir(Path(run)) else ""
            raise InferError(
                f"run={run} and ckpt={ckpt_path} do not agree: the checkpoint is of the run {run_dir}, not "
                f"run={run} (whose folder would get its results); pass ckpt={ckpt_path} alone (results in "
                f"{run_dir}){alone}"
            )
        try:
            state = load_record(p)
        except ValueError as e:
            raise InferError(f"ckpt={ckpt_path} does not load: {e}") from e
        return p, state, Path(run) if run else run_dir
    if not run:
        raise InferError("say which run to use: run=runs/<run> (its newest checkpoint) or ckpt=PATH")
    run_dir = Path(run)
    if not run_dir.is_dir():
        what = "is a file, not a run directory" if run_dir.exists() else "no such run directory"
        newest = ckpt.newest_run_with_checkpoints(run_dir.parent) if run_dir.parent.is_dir() else None
        hint = f"newest run with checkpoints: run={newest}" if newest else "runs are folders under runs/"
        raise InferError(f"run={run}: {what} ({hint})")
    path, state = None, None
    for _, p in ckpt.list_checkpoints(run_dir):
        try:
            path, state = p, load_record(p)
            break
        except ValueError as e:
            warn(f"warning: checkpoint {p} does not load ({e}); trying an older one")
    if state is None:
        raise InferError(no_checkpoint_message(run, run_dir))
    step, summary = int(state["step"]), read_summary(run_dir)
    if lost := ckpt.lost_after(run_dir, step, summary):
        at, how = lost
        final = "final" if summary.get("status") == "ok" and summary.get("steps") == at else "newest"
        warn(
            f"warning: run={run}: its {final} weights (step {at}) are gone: {how}; using {path.name} (step "
            f"{step}) instead, which is NOT the model the run ended with. Rebuild the lost weights with: "
            f"python train.py resume=true out_dir={run_dir} (it replays the steps after {step} with the "
            "run's own schedule)"
        )
    elif isinstance(trained := summary.get("steps"), int) and trained > step:  # e.g. checkpoint.at_end=false
        warn(
            f"warning: run={run} trained to step {trained}, but its newest checkpoint is {path.name} (step "
            f"{state['step']}): no checkpoint holds {step_span(int(state['step']) + 1, trained)}, so these "
            "are not the weights the run ended with"
        )
    return path, state, run_dir


def _checkpoint_dir(ckpt_path: str) -> Path:
    p = Path(ckpt_path)
    if not p.exists():
        in_run = p.parent.name == ckpt.CKPT_DIR_NAME  # runs/<run>/ckpt/step_<N>: list the run's checkpoints
        there = [c.name for _, c in ckpt.list_checkpoints(p.parent.parent)] if in_run else []
        listed = f"; {p.parent} holds {', '.join(there)}" if there else ""
        raise InferError(f"ckpt={ckpt_path}: no such checkpoint directory{listed}")
    if p.is_file():  # flashgpt.pt or another file of the checkpoint
        p = p.parent
    if is_run_dir(p) or ckpt.list_checkpoints(p):
        raise InferError(f"ckpt={ckpt_path} is a run directory, not a checkpoint: did you mean run={p}?")
    if p.name == ckpt.CKPT_DIR_NAME:
        raise InferError(
            f"ckpt={ckpt_path} is the checkpoint folder of a run: pass run={p.parent} (its newest) or "
            f"ckpt={p}/step_<N>"
        )
    return p


def load_record(p: Path) -> dict:
    """``checkpoint.load_checkpoint(p)``; ValueError also for a record torch cannot read."""
    try:
        return ckpt.load_checkpoint(p)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - torch.load of a corrupt or foreign file: any exception
        why = f"torch.load: {type(e).__name__}"
        raise ValueError(f"{p / ckpt.RECORD} is corrupt or not a flashgpt checkpoint record ({why})") from e


def no_checkpoint_message(run: str, run_dir: Path) -> str:
    """Why ``run`` has no checkpoint that loads: not a run, a ckpt/ folder, still running, or ended early."""
    found = len(ckpt.list_checkpoints(run_dir))
    where = f"looked in {ckpt.ckpt_dir(run_dir)}"
    if found:
        return f"run={run}: none of its {found} checkpoints loads ({where}); pass ckpt=PATH of one that loads"
    if run_dir.name == ckpt.CKPT_DIR_NAME and is_run_dir(run_dir.parent):
        return f"run={run} is the checkpoint folder of a run: pass run={run_dir.parent}"
    if run_dir.parent.name == ckpt.CKPT_DIR_NAME and is_run_dir(run_dir.parent.parent):
        return (
            f"run={run} is a checkpoint of a run: did you mean ckpt={run}? (or run={run_dir.parent.parent})"
        )
    if not is_run_dir(run_dir):
        return (
            f"run={run} is not a flashgpt run directory (no summary.json or config.resolved.yaml): pass "
            "run=runs/<name> of a trained run, or ckpt=PATH of a checkpoint"
        )
    status, _ = true_status(run_dir, read_summary(run_dir))
    if status == "running":
        return (
            f"run={run} has no checkpoint yet ({where}): it is still running (summary.json status "
            "'running'); wait for its first checkpoint (checkpoint.interval)"
        )
    how = {KILLED: "was killed", None: "stopped (no summary.json)"}.get(status, f"ended (status {status!r})")
    how = f"it {how} before its first checkpoint (checkpoint.interval)"
    if last := read_summary(run_dir).get("last_checkpoint"):  # it wrote some, deleted since
        how = f"its checkpoints are gone (it wrote up to {Path(last).name}; ckpt/ holds none now)"
    return (
        f"run={run} has no checkpoint ({where}): {how}; train anew, or pass ckpt=PATH of another checkpoint"
    )


def run_data_dir(state: dict, run_dir: Path) -> str | None:
    """The ``data.dir`` of a checkpoint's run (as its cwd meant it), None when it names none."""
    data_dir = ((state.get("config") or {}).get("data") or {}).get("dir")
    return anchored(str(data_dir), run_cwd(run_dir)) if data_dir else None


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise InferError(f"device={device!r} is not a device; use auto, cpu or cuda") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InferError(f"device={device} but no CUDA GPU is available; use device=cpu (or auto)")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise InferError(f"dtype={dtype!r} is not supported; use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def build_model(
    state: dict, attention: str | None, sdpa_backend: str | None, device: torch.device, dtype: torch.dtype
):
    """The checkpoint's GPT in eval mode on ``device`` in ``dtype``, with backend ``attention`` and
    ``sdpa_backend`` (None: the trained ones)."""
    from model import GPT, GPTConfig

    args = {**state["model_args"], "dropout": 0.0}  # inference: no dropout whatever the run trained with
    args |= {k: v for k, v in (("attention", attention), ("sdpa_backend", sdpa_backend)) if v}
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    try:
        config = GPTConfig(**{k: v for k, v in args.items() if k in fields})
    except ValueError as e:
        raise InferError(f"attention={args.get('attention')}: {e}") from e
    if config.attention == "flash":
        from kernels import check_flash_available

        try:
            check_flash_available(device)
        except RuntimeError as e:
            raise InferError(f"attention=flash: {e}") from e
        if device.type == "cpu" and dtype == torch.bfloat16:
            raise InferError(
                "attention=flash on the CPU (Triton interpreter) runs float32/float16 only; use dtype=float32"
            )
    model = GPT(config)
    if "weights" in state:  # init_from (model.pretrained.inference_record): GPT-2's weights, no checkpoint
        from model.pretrained import load_into

        load_into(model, state["weights"], state["path"])
        return model.to(device=device, dtype=dtype).eval()
    try:
        ckpt.load_weights(state["path"], model)  # in this process alone, whatever world size saved it
    except Exception as e:  # noqa: BLE001 - DCP's CheckpointException, shapes that do not fit
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InferError(
            f"the checkpoint's weights do not fit its model_args: {text} (to inspect it as one file: python "
            f"-m torch.distributed.checkpoint.format_utils dcp_to_torch {state['path']} OUT.pt)"
        ) from e
    return model.to(device=device, dtype=dtype).eval()


def read_prompt(prompt: str) -> str:
    """``prompt`` itself, or the UTF-8 text of PATH for ``file:PATH``."""
    if prompt.startswith("file:"):
        path = Path(os.path.expanduser(prompt[len("file:") :]))
        try:
            return path.read_text(encoding="utf-8-sig")  # a leading byte-order mark is no prompt text
        except FileNotFoundError:
            msg = f"prompt=file:{path}: no such file; name an existing one, or prompt=TEXT"
            raise InferError(msg) from None
        except (OSError, UnicodeDecodeError) as e:
            raise InferError(f"prompt=file:{path}: cannot read it as UTF-8 text ({e})") from e
    return prompt


def claim_new_file(folder: Path, stem: str, suffix: str, siblings: tuple[str, ...] = ()) -> Path:
    """``folder/stem{suffix}``, or ``stem-2``, ``stem-3``, ..."""
    folder.mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        path = folder / (f"{stem}{suffix}" if n == 1 else f"{stem}-{n}{suffix}")
        if any(path.with_suffix(s).exists() for s in siblings):
            continue
        try:
            with open(path, "x", encoding="utf-8"):
                return path
        except FileExistsError:
            continue
    raise InferError(f"{folder} holds 10,000 files named {stem}*{suffix}; clean it up or pass out=PATH")


def checkpoint_of(cfg) -> tuple[Path, dict, Path | None]:
    """(path, record, run directory) of sample.py's / eval.py's ``init_from`` (released weights, no run:
    None), else of ``ckpt`` / ``run`` (``find_checkpoint``)."""
    if cfg.init_from:
        from model.pretrained import inference_record

        return Path(cfg.init_from), inference_record(cfg.init_from, cfg.run, cfg.ckpt), None
    return find_checkpoint(cfg.run, cfg.ckpt)


def write_results(
    out, run_dir: Path | None, folder: str, stem: str, texts: dict[str, str], what: str, option: str
) -> Path | None:
    """Write ``texts`` ({suffix: text}, the first the main file) to ``out`` (``out=``; the others beside it
    by suffix), else to new files ``<run_dir>/<folder>/<stem>*`` (``claim_new_file``: never another
    result's). Where they cannot be written (a read-only run directory, a colleague's runs, a full disk) a
    note says where, why and the ``option`` that writes them elsewhere; None (the result is printed
    already, the exit status stays 0)."""
    suffixes = list(texts)
    path = None
    try:
        if out:
            path = Path(str(out)).expanduser()
            path.parent.mkdir(parents=True, exist_ok=True)
        else:
            path = claim_new_file(run_dir / folder, stem, suffixes[0], siblings=tuple(suffixes[1:]))
        for i, (suffix, text) in enumerate(texts.items()):
            (path.with_suffix(suffix) if i else path).write_text(text, encoding="utf-8")
    except OSError as e:
        if path is not None and not out:
            for suffix in suffixes:
                with contextlib.suppress(OSError):
                    path.with_suffix(suffix).unlink()  # what claim_new_file made
        where = path if path is not None else (Path(str(out)) if out else run_dir / folder)
        print(
            f"note: {what} not written: {where} ({e.strerror or type(e).__name__}); the result is printed "
            f"above. Pass {option} to write it elsewhere",
            file=sys.stderr,
        )
        return None
    return path
