"""The kernel plan (kernels/plan.py): its table in the README, the rule's pure functions, the run description.

Plain torch: no triton import and no kernel launch, so these run in a blink on the CPU.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import plan

REPO = Path(__file__).resolve().parents[2]


def test_readme_table_is_the_plan():
    """README.md between the kernel-plan markers holds exactly what `python -m kernels` prints."""
    out = subprocess.run(
        [sys.executable, "-m", "kernels"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    readme = (REPO / "README.md").read_text()
    m = re.search(r"<!-- kernel-plan:begin -->\n(.*?)\n<!-- kernel-plan:end -->", readme, re.S)
    assert m, "README.md has no <!-- kernel-plan:begin --> ... <!-- kernel-plan:end --> block"
    assert m.group(1).strip() == out.stdout.strip(), (
        "README's kernel table differs: paste `python -m kernels`"
    )


def test_table_follows_the_crossovers(monkeypatch):
    """The table is computed from the rule: moving a crossover moves the Gluon rows, and the environment
    variables of the caller do not leak into it."""
    monkeypatch.setenv(plan.ENV, "0")  # the table shows the defaults whatever the caller's environment
    base = plan.table()
    assert "| 64 | >= 4096 | bf16, fp16 | no | Gluon FA3 (sm_90) | Gluon FA3 (sm_90) |" in base
    assert "| 128 | 1024 | bf16, fp16 | any | Gluon FA3 (sm_90) |" in base
    monkeypatch.setitem(plan.MIN_N, 64, 8192)
    moved = plan.table()
    assert moved != base and "| 64 | 4096..8191 | bf16, fp16 | no | Triton FA2 128x64 w8 s3 | Gluon" in moved


@pytest.mark.parametrize("how,n,expect", [("auto", 1024, False), ("auto", 2048, True), ("1", 128, True),
                                          ("0", 8192, False)])  # fmt: skip
def test_use_gluon_forward_rule(how, n, expect):
    assert plan.use_gluon("fwd", how, 64, n, n, torch.bfloat16, True, True) is expect


def test_use_gluon_excludes():
    """What the Gluon kernels never take: variants, fp32, other d, Nq != Nk, GQA or ragged N backward."""
    g = plan.use_gluon
    assert not g("fwd", "1", 64, 4096, 4096, torch.bfloat16, False, True)  # window / docs / dropout
    assert not g("fwd", "1", 64, 4096, 4096, torch.float32, True, True)
    assert not g("fwd", "1", 96, 4096, 4096, torch.bfloat16, True, True)
    assert not g("fwd", "1", 64, 4096, 4000, torch.bfloat16, True, True)
    assert g("bwd", "auto", 64, 4096, 4096, torch.float16, True, True)
    assert not g("bwd", "auto", 64, 4096, 4096, torch.float16, True, False)  # GQA, or deterministic
    assert not g("bwd", "1", 64, 4000, 4000, torch.float16, True, True)  # N % 128 != 0
    assert not g("bwd", "auto", 128, 1024, 1024, torch.bfloat16, True, True)  # below MIN_N_BWD


def test_plan_on_cpu_tensors_is_triton_with_interpreter_tiles(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(plan.ENV, "1")
    q = torch.randn(1, 2, 256, 64, dtype=torch.bfloat16)
    p = plan.plan_fwd(q, q, q, True, 0.125)
    assert p == plan.Plan("fwd", "triton", 64, (plan.TileConfig(32, 16, 4, 1),))
    b = plan.plan_bwd(q, q, q, q, q, True, 0.125)
    assert b.backend == "triton" and b.tiles == (plan.TileConfig(32, 16, 4, 1), plan.TileConfig(16, 32, 4, 1))
    assert b.tma == (None, None)  # the interpreter tiles name no tensor descriptors
    with pytest.raises(AttributeError):
        p.backend = "gluon"  # a frozen record


def test_describe_one_line(monkeypatch):
    monkeypatch.delenv(plan.ENV, raising=False)
    line = plan.describe(64, 1024, torch.float32, "cpu")
    assert "\n" not in line and line.startswith("d=64 N=1024 fp32 interpreter: fwd Triton FA2 32x16")
    assert "decode split-K" in line
    monkeypatch.setenv(plan.ENV_BWD, "maybe")
    with pytest.raises(ValueError, match="FLASHGPT_GLUON_BWD='maybe'"):
        plan.describe(64, 1024, torch.bfloat16, "cpu")


def test_softcap_runs_the_triton_kernels_and_the_plan_says_so(monkeypatch):
    """The Gluon kernels take no soft-capping: on an sm_90 (faked here: the rule is plain torch) a softcap
    run describes the Triton kernels where the plain run gets Gluon, and names the cap and why."""
    monkeypatch.delenv(plan.ENV, raising=False)
    monkeypatch.delenv(plan.ENV_BWD, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    plain = plan.describe(64, 8192, torch.bfloat16, "cuda")
    capped = plan.describe(64, 8192, torch.bfloat16, "cuda", softcap=30.0)
    assert "fwd Gluon FA3" in plain and "bwd Gluon FA3" in plain, plain
    assert "Gluon FA3" not in capped and "bwd Triton FA2 split" in capped, capped
    assert "softcap=30 (Triton: the Gluon kernels take none)" in capped and "fwd Triton FA2" in capped
    assert "soft-capping (`softcap`) always run the Triton kernels" in plan.table()
    grouped = plan.describe(64, 8192, torch.bfloat16, "cuda", kv_group=4)  # the Gluon backward is MHA only
    assert "fwd Gluon FA3" in grouped and "bwd Triton FA2 split" in grouped and "kv_group=4" in grouped, (
        grouped
    )


def test_the_run_logs_the_kernels_of_its_own_model(monkeypatch):
    """The trainer's kernel line (setup.kernel_plan) passes the model's soft-cap and KV grouping: a capped
    or grouped run on an sm_90 does not claim the Gluon kernels that its calls cannot take."""
    from types import SimpleNamespace

    from model.config import GPTConfig
    from trainer.setup import kernel_plan

    monkeypatch.delenv(plan.ENV, raising=False)
    monkeypatch.delenv(plan.ENV_BWD, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))

    def line(**model):
        cfg = SimpleNamespace(attention=SimpleNamespace(name="flash"), seq_len=8192, deterministic=False)
        g = GPTConfig(n_layer=1, n_head=12, n_embd=768, block_size=8192, attention="flash", **model)
        st = SimpleNamespace(cfg=cfg, gpt_config=g, plan=SimpleNamespace(autocast_dtype="bfloat16"))
        st.device = torch.device("cuda")
        return kernel_plan(st)

    assert "bwd Gluon FA3" in line(), line()
    assert "Gluon FA3" not in line(softcap=30.0) and "softcap=30" in line(softcap=30.0), line(softcap=30.0)
    assert "bwd Triton FA2 split" in line(n_kv_head=4) and "kv_group=3" in line(n_kv_head=4), line(
        n_kv_head=4
    )


def test_kernels_import_graph_has_no_cycle():
    """kernels/ modules import each other without a circle (module- and function-level imports, and the
    modules the plan and the launchers load by name)."""
    import ast

    graph = {}
    for path in (REPO / "kernels").glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
        graph[path.stem] = deps
    graph["plan"] |= {"_gluon_fwd", "_gluon_bwd"}  # importlib.import_module in plan.gluon
    graph["_launch"] |= {"_triton_kernels", "_triton_common", "_decode_kernels"}  # _launch.kernel_module
    done, path = set(), []

    def visit(m):
        assert m not in path, f"import circle: {' -> '.join(path[path.index(m) :] + [m])}"
        if m in done or m not in graph:
            return
        path.append(m)
        for d in sorted(graph[m]):
            visit(d)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)
    assert {"plan", "_launch", "flash_attn", "_runtime"} <= done
