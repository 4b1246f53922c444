"""Many short sample.py / eval.py command lines in one process, each as ``python SCRIPT ARGS`` would run it.

The refusal tests run dozens of commands that stop before any model work; a process each costs ~4 s on 2 cores
(importing torch and Hydra), most of their time. ``run_commands`` starts one process for a list of commands;
in it each command gets its own ``sys.argv``, working directory and a fresh Hydra, and its exit status, stdout
and stderr are recorded as a process's would be (an uncaught exception prints its traceback and gives 1, a
string passed to ``sys.exit`` goes to stderr), and the folders it names are listed before and after it.
A command that must differ in its environment or its imports still needs a process of its own.

    python -m tests.infer_batch CASES.json RESULTS.json
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import runpy
import subprocess
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace


def listing(d) -> dict[str, str | None]:
    """Relative path -> sha256 of each file (None for a folder) under ``d``: what a refused command leaves."""
    d = Path(d)
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
        for p in sorted(d.rglob("*"))
    }


def run_commands(cases: list[dict], work: Path, env: dict) -> list[SimpleNamespace]:
    """Run ``cases`` ({"script", "args", "cwd", "watch": [folders]}) in one process with environment ``env``;
    per case (returncode, stdout, stderr, before and after: ``listing`` of each watched folder before and
    after the command)."""
    work.mkdir(parents=True, exist_ok=True)
    src, dst = work / "cases.json", work / "results.json"
    src.write_text(json.dumps(cases))
    repo = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "tests.infer_batch", str(src), str(dst)]
    proc = subprocess.run(cmd, cwd=str(repo), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and dst.is_file(), (
        f"the batch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return [SimpleNamespace(**r) for r in json.loads(dst.read_text())]


def _run_one(case: dict) -> dict:
    from hydra.core.global_hydra import GlobalHydra

    out, err, code = io.StringIO(), io.StringIO(), 0
    before = [listing(d) for d in case.get("watch", [])]
    cwd, environ = os.getcwd(), dict(os.environ)
    os.chdir(case["cwd"])
    sys.argv = [case["script"], *case["args"]]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(case["script"], run_name="__main__")
            except SystemExit as e:
                if isinstance(e.code, int) or e.code is None:
                    code = e.code or 0
                else:  # sys.exit("message"): Python prints it and exits 1
                    print(e.code, file=sys.stderr)
                    code = 1
            except BaseException:  # noqa: BLE001 - as the interpreter does with an uncaught exception
                traceback.print_exc()
                code = 1
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)
        GlobalHydra.instance().clear()
    after = [listing(d) for d in case.get("watch", [])]
    return {
        "returncode": code,
        "stdout": out.getvalue(),
        "stderr": err.getvalue(),
        "before": before,
        "after": after,
    }


if __name__ == "__main__":
    cases = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps([_run_one(c) for c in cases]))
