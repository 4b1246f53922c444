"""Generate text from a trained run's checkpoint (Hydra entry point; config ``configs/sample.yaml``).

    python sample.py run=runs/<run>                               # newest loadable checkpoint, 3 samples
    python sample.py run=runs/<run> prompt="ROMEO:" temperature=0 max_new_tokens=200
    python sample.py ckpt=runs/<run>/ckpt/step_00000300 prompt=file:prompt.txt top_p=0.9
    TRITON_INTERPRET=1 python sample.py run=runs/<run> attention=flash max_new_tokens=20   # CPU, slow
    python sample.py init_from=gpt2 prompt="Hello" out=gpt2.txt     # GPT-2's released weights, no run

Model and tokenizer come from the checkpoint alone (model_args, weights, tokenizer with its char
vocabulary). The prompt is prefilled into a KV cache with the chosen backend, then one token per sample per
step is decoded (``GPT.generate``). Samples are printed and written to ``<run>/samples/<time>_<ckpt>.txt``
with a ``.json`` of the settings, token ids and prefill / decode tokens per second (``out=PATH.txt``:
there; ``write=false``: console only). Where they cannot be written (a read-only run directory) a note
says so and the exit status stays 0.

Exit status: 0 ok; 2 for a user error (``error: ...``: no run or checkpoint, ``run=`` with a ``ckpt=`` of
another run, a prompt the tokenizer cannot encode, temperature < 0, top_k < 1, top_p outside (0, 1], ...),
with nothing written; also for a config error (``config error: ...``: a misspelt key such as
``temprature=0.5``, ``+typo=1``, a wrong type). Prefixes as train.py's: the kind, no script name.
Keys: ``trainer/infer_config.py`` ``SampleConfig``.
"""

from __future__ import annotations

import json
import sys
import time

import hydra
from omegaconf import DictConfig

from trainer.fields import report_config_errors
from trainer.infer import InferError
from trainer.infer_config import SampleConfig, run_job


def _sample(cfg: DictConfig) -> None:
    """Sample for ``cfg`` (``SampleConfig``, configs/sample.yaml); a user error raises ``InferError``."""
    import torch

    from model.sampling import check_sampling_args
    from trainer.checkpoint import tokenizer_from_checkpoint
    from trainer.infer import (
        build_model,
        checkpoint_of,
        read_prompt,
        resolve_device,
        resolve_dtype,
        write_results,
    )

    # settings first: a bad key costs no checkpoint load
    top_k = cfg.top_k
    top_p = None if cfg.top_p is None else float(cfg.top_p)
    try:
        check_sampling_args(float(cfg.temperature), top_k, top_p)
    except (TypeError, ValueError) as e:
        raise InferError(str(e)) from e
    device = resolve_device(str(cfg.device))
    dtype = resolve_dtype(str(cfg.dtype), device)
    graph_ok = device.type == "cuda" and bool(cfg.use_cache)
    if cfg.cuda_graph and not graph_ok:
        raise InferError(
            f"cuda_graph=true needs device=cuda and use_cache=true (device is {device}, use_cache="
            f"{str(bool(cfg.use_cache)).lower()}); drop cuda_graph=true"
        )
    cuda_graph = graph_ok if cfg.cuda_graph is None else bool(cfg.cuda_graph)  # null: on where it can run
    text = read_prompt(str(cfg.prompt))
    if not text:
        # (not prompt='\n': Hydra passes that on as a backslash and an n, which no char vocabulary has)
        raise InferError(
            "prompt is empty; give some text, e.g. prompt=ROMEO: (with spaces: \"prompt='First Citizen:'\"), "
            "or prompt=file:PATH for a file's text (to start at a new line: printf '\\n' > nl.txt, then "
            "prompt=file:nl.txt)"
        )

    path, state, run_dir = checkpoint_of(cfg)  # init_from: no run, nothing is written without out=
    try:
        tok = tokenizer_from_checkpoint(state)
    except (ValueError, RuntimeError) as e:
        raise InferError(f"tokenizer of {path}: {e}") from e
    try:
        ids = tok.encode_prompt(text)
    except ValueError as e:
        raise InferError(f"prompt cannot be encoded by the run's {tok.name} tokenizer: {e}") from e
    model = build_model(state, cfg.attention.name, cfg.attention.sdpa_backend, device, dtype)
    static = bool(cfg.static_decode or cfg.compile or cuda_graph)  # a CUDA graph replays the static step
    check_generation_backend(model.config.attention, bool(cfg.use_cache), static)
    block = model.config.block_size
    if len(ids) > block:
        print(
            f"note: the prompt is {len(ids)} tokens, more than the block size {block}: keeping its "
            f"last {block} tokens",
            file=sys.stderr,
        )
        ids = ids[-block:]
    if cfg.compile:  # compile the static-shape decode step: one graph for every position
        model._decode_static = torch.compile(model._decode_static)

    prompt = torch.tensor([ids] * int(cfg.num_samples), dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(int(cfg.seed))
    timings: dict = {}
    out = model.generate(
        prompt,
        int(cfg.max_new_tokens),
        temperature=float(cfg.temperature),
        top_k=top_k,
        top_p=top_p,
        generator=gen,
        use_cache=bool(cfg.use_cache),
        timings=timings,
        vocab_size=tok.vocab_size,
        static_decode=bool(cfg.compile or cfg.static_decode),
        cuda_graph=cuda_graph,
    )
    new = out[:, len(ids) :].tolist()
    samples = [tok.decode(row) for row in new]

    rate = {
        "prefill_tokens_per_sec": timings["prefill_tokens"] / max(timings["prefill_s"], 1e-9),
        "decode_tokens_per_sec": timings["decode_tokens"] / max(timings["decode_s"], 1e-9),
    }
    prompt_text = tok.decode(ids)
    for i, s in enumerate(samples):
        print(f"---------- sample {i + 1}/{len(samples)}")
        print(prompt_text + s)
    print("----------")
    # greedy decoding has no randomness to vary (said only when true: batched rows could differ in a tie)
    if float(cfg.temperature) == 0 and len(new) > 1 and all(row == new[0] for row in new):
        print(
            f"note: temperature=0 is greedy: the {len(samples)} samples are identical (num_samples=1 "
            "gives one; temperature > 0 varies them)",
            file=sys.stderr,
        )
    # the SDPA kernel when pinned (attention.sdpa_backend=math), as the run's own attention/backend_ran
    attention = model.attention_backend
    if attention == "sdpa" and model.config.sdpa_backend != "auto":
        attention += f" (sdpa_backend={model.config.sdpa_backend})"
    print(
        f"{path} | attention={attention} | device={device} | dtype={str(dtype)[6:]} | "
        f"prefill {timings['prefill_tokens']} tokens at {rate['prefill_tokens_per_sec']:.1f} tok/s | "
        f"decode {timings['decode_tokens']} tokens at {rate['decode_tokens_per_sec']:.1f} tok/s"
    )

    record = {
        "checkpoint": str(path),
        "step": int(state["step"]),
        "prompt": prompt_text,
        "prompt_tokens": len(ids),
        "num_samples": int(cfg.num_samples),
        "max_new_tokens": int(cfg.max_new_tokens),
        "temperature": float(cfg.temperature),
        "top_k": top_k,
        "top_p": top_p,
        "seed": int(cfg.seed),
        "attention": model.attention_backend,
        "device": str(device),
        "dtype": str(dtype)[6:],
        "use_cache": bool(cfg.use_cache),
        # what ran: without the cache no decode step is compiled, static or graphed
        "compile": bool(cfg.compile and cfg.use_cache),
        "static_decode": bool(cfg.use_cache and (cfg.compile or cfg.static_decode or cuda_graph)),
        "cuda_graph": cuda_graph,
        **timings,
        **rate,
        "samples": samples,
        "token_ids": new,
    }
    if not cfg.write:
        return
    if run_dir is None and not cfg.out:  # init_from: no run directory to write into
        print(
            "note: init_from has no run directory: printed only (out=PATH.txt writes them)", file=sys.stderr
        )
        return
    stem = f"{time.strftime('%Y%m%d-%H%M%S')}_{path.stem}"
    text = "".join(
        f"---------- sample {i + 1}/{len(samples)}\n{prompt_text}{s}\n" for i, s in enumerate(samples)
    )
    texts = {".txt": text, ".json": json.dumps(record, indent=1) + "\n"}
    if txt := write_results(cfg.out, run_dir, "samples", stem, texts, "samples", "out=PATH.txt"):
        print(f"samples written to {txt}")


def check_generation_backend(name: str, use_cache: bool, static: bool) -> None:
    """A backend added with ``register_attention_backend`` may lack the KV cache or the static decode step:
    say which key works instead of failing inside generation."""
    from model.attention import BACKENDS

    b = BACKENDS[name]
    if use_cache and not b.kv_cache:
        raise InferError(
            f"attention={name} was registered without kv_cache=True, so it cannot generate with a KV cache; "
            "pass use_cache=false (the whole context every token: slower), or register it with kv_cache=True"
        )
    if use_cache and static and b.decode is None:
        raise InferError(
            f"attention={name} has no static decode step (register_attention_backend(..., decode=fn)); drop "
            "static_decode=true / compile=true"
        )


@hydra.main(config_path="configs", config_name="sample", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_job(cfg, SampleConfig, _sample)


if __name__ == "__main__":
    sys.exit(report_config_errors(main, SampleConfig))
