#!/usr/bin/env bash
# The H200 runs whose results are committed under bench/results/ (index: bench/results/README.md).
# Usage: bash bench/h200_runs.sh PHASE [OUTDIR]     (PHASE: kernels | throughput | compare | parity | compare_seed |
#        compare_dropout | sweep | preempt | window_ablation | multigpu | peer | peer_models | vs_old | fused_loss | softcap | gqa | ablations |
#        context | redesign)
# Data: $TINYSHAKESPEARE (default ../shared/data/tinyshakespeare.txt). Runs go to OUTDIR (default runs/h200).
# ablations and context train on $CODE (default: $OUT/code_src, every .py file of the installed packages that is
# UTF-8 text copied into one folder, a corpus of long documents any GPU machine has; the prepare step refuses a
# file that is not UTF-8), prepared once into data/code (GPT-2 BPE, at most 100M tokens).
set -uo pipefail
PHASE=${1:?usage: bash bench/h200_runs.sh PHASE [OUTDIR]; PHASE: kernels|throughput|compare|parity|compare_seed|compare_dropout|sweep|preempt|window_ablation|multigpu|peer|peer_models|vs_old|fused_loss|softcap|softcap_triton|gqa|ablations|context|redesign}
OUT=${2:-runs/h200}
SRC=${TINYSHAKESPEARE:-../shared/data/tinyshakespeare.txt}
case "$PHASE" in kernels|throughput|compare|parity|compare_seed|compare_dropout|sweep|preempt|window_ablation|multigpu|peer|peer_models|vs_old|fused_loss|softcap|softcap_triton|gqa|ablations|context|redesign) ;;
*) echo "unknown phase $PHASE (kernels|throughput|compare|parity|compare_seed|compare_dropout|sweep|preempt|window_ablation|multigpu|peer|peer_models|vs_old|fused_loss|softcap|softcap_triton|gqa|ablations|context|redesign)"; exit 2 ;;
esac
mkdir -p "$OUT"
common=(data.source="$SRC" wandb.mode=offline wandb.project=flashgpt-h200)
CODE=${CODE:-$OUT/code_src}
code_corpus() {  # copy the UTF-8 .py files of the installed packages (the folder of torch) into $CODE, once
  [ -d "$CODE" ] && return
  python - "$(python -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')" "$CODE" <<'PY'
import pathlib, sys
src, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
kept = skipped = 0
for p in sorted(src.rglob("*.py")):
    raw = p.read_bytes() if p.is_file() else None
    try:
        raw.decode("utf-8")
    except (AttributeError, UnicodeDecodeError):
        skipped += raw is not None
        continue
    (dst / p.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
    (dst / p.relative_to(src)).write_bytes(raw)
    kept += 1
print(f"code corpus: {kept} .py files from {src} in {dst}; {skipped} not UTF-8 left out")
PY
}
gpu_tag() {  # h200, h100, ...: the card a result file's name says it ran on (the phases run on either)
  python -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())" 2>/dev/null || echo gpu
}
code=(data.source="$CODE" data.dir=data/code data.max_tokens=100000000 attention.document_mask=false
      wandb.mode=offline wandb.project=flashgpt-h200)

case "$PHASE" in
kernels)  # the kernel benchmarks: attention, decode step and generation, attention variants (bench/results/*_h200*)
  python -m bench.attention --seqlens 1024,2048,4096,8192,16384 --headdims 64,128 \
    --providers flash,flash-det,sdpa-cudnn,sdpa-flash,sdpa-efficient,flex --out "$OUT" --tag h200
  python -m bench.decode --contexts 8192,16384,32768,65536,131072 --batches 1,16 --dims 64,128 --groups 1,4,8 \
    --providers flash-decode,read-floor,sdpa-auto,sdpa-flash,sdpa-cudnn,sdpa-efficient --out "$OUT" --tag h200
  python -m bench.decode --e2e-only --batches 1,16 --e2e-backends flash,sdpa --out "$OUT" --tag h200_e2e
  python -m bench.variants --modes fwd+bwd --out "$OUT"
  python -m bench.variants --modes fwd --out "$OUT" --tag h200_fwd ;;
throughput)  # the default command, flash and sdpa at seq_len 4096 and 8192 (bench.throughput): tokens/sec, MFU,
  # memory, GPU busy
  for n in 8192 4096; do
    python -m bench.throughput --backends flash,sdpa --seq-lens $n --steps 25 --warmup 8 \
      --out "$OUT/throughput_h200_$n" --runs-dir "$OUT/throughput_runs" -- data.source="$SRC"
  done ;;
compare)  # 500 steps of each backend at seq_len 1024 from the same seed; loss logged every step
  for a in flash sdpa naive; do
    python train.py experiment=gpt2_shakespeare attention=$a seq_len=1024 max_steps=500 compile=false \
      batch.tokens_per_step=16384 log_interval=1 eval.interval=100 eval.batches=10 checkpoint.at_end=false \
      wandb.group=compare_n1024 "${common[@]}" out_dir="$OUT/compare_$a"
  done
  python -m bench.compare "$OUT"/compare_sdpa "$OUT"/compare_flash "$OUT"/compare_naive \
    --window 20 --out "$OUT/compare.png" --json "$OUT/compare.json"
  python -m bench.compare "$OUT"/compare_sdpa "$OUT"/compare_flash "$OUT"/compare_naive \
    --window 20 --max-step 300 --out "$OUT/compare_300.png" --json "$OUT/compare_300.json" ;;
parity)  # issue-3 criterion over seeds, and its noise floor: 300-step runs at seq_len 1024 (same seed = same
  # init and data). flash and sdpa (cuDNN here) for seeds 1337-1339; SDPA's own exact kernels (FlashAttention-2,
  # efficient) for seed 1337; with WITH_FP32=1 also a float32 run without TF32 (closest to exact arithmetic).
  p=(experiment=gpt2_shakespeare seq_len=1024 max_steps=300 compile=false batch.tokens_per_step=16384
     log_interval=1 eval.interval=100 eval.batches=10 checkpoint.interval=0 checkpoint.at_end=false
     wandb.group=parity_n1024 "${common[@]}")
  for s in 1337 1338 1339; do for a in flash sdpa; do
    python train.py "${p[@]}" attention=$a seed=$s out_dir="$OUT/p300_${a}_s$s"
  done; done
  python train.py "${p[@]}" attention=sdpa attention.sdpa_backend=flash out_dir="$OUT/p300_sdpafa2_s1337"
  python train.py "${p[@]}" attention=sdpa attention.sdpa_backend=efficient out_dir="$OUT/p300_sdpaeff_s1337"
  [ -n "${WITH_FP32:-}" ] && python train.py "${p[@]}" attention=sdpa dtype=float32 tf32=false out_dir="$OUT/p300_fp32_s1337"
  python -m bench.compare "$OUT"/p300_sdpa_s1337 "$OUT"/p300_flash_s1337 "$OUT"/p300_sdpafa2_s1337 \
    "$OUT"/p300_sdpaeff_s1337 --window 20 --out "$OUT/parity_s1337.png" \
    --json "$OUT/parity_s1337.json"
  for s in 1338 1339; do
    python -m bench.compare "$OUT"/p300_sdpa_s$s "$OUT"/p300_flash_s$s --window 20 \
      --out "$OUT/parity_s$s.png" --json "$OUT/parity_s$s.json"
  done ;;
compare_seed)  # the 500-step comparison of `compare` with a second seed, plus SDPA's FlashAttention-2 at seed 1337
  c=(experiment=gpt2_shakespeare seq_len=1024 max_steps=500 compile=false batch.tokens_per_step=16384 log_interval=1
     eval.interval=100 eval.batches=10 checkpoint.interval=0 checkpoint.at_end=false wandb.group=compare_n1024 "${common[@]}")
  for a in flash sdpa naive; do
    python train.py "${c[@]}" attention=$a seed=1338 out_dir="$OUT/compare_${a}_s1338"
  done
  python train.py "${c[@]}" attention=sdpa attention.sdpa_backend=flash out_dir="$OUT/compare_sdpafa2"
  python -m bench.compare "$OUT"/compare_sdpa_s1338 "$OUT"/compare_flash_s1338 "$OUT"/compare_naive_s1338 \
    --window 20 --out "$OUT/compare_s1338.png" --json "$OUT/compare_s1338.json"
  # needs the `compare` phase's runs: SDPA's two exact kernels against each other, beside flash and naive
  python -m bench.compare "$OUT"/compare_sdpa "$OUT"/compare_flash "$OUT"/compare_naive "$OUT"/compare_sdpafa2 \
    --window 20 --out "$OUT/compare_noise.png" --json "$OUT/compare_noise.json" ;;
compare_dropout)  # the 500-step comparison of `compare` with residual/embedding dropout 0.2 (nanoGPT's Shakespeare
  # setting; attention probabilities get none), seed 1337, plus a second sdpa run of the same config (its noise floor)
  c=(experiment=gpt2_shakespeare seq_len=1024 max_steps=500 compile=false batch.tokens_per_step=16384 log_interval=1
     eval.interval=100 eval.batches=10 checkpoint.interval=0 checkpoint.at_end=false model.dropout=0.2
     wandb.group=compare_dropout_n1024 "${common[@]}")
  for a in flash sdpa naive; do
    python train.py "${c[@]}" attention=$a out_dir="$OUT/compare_dropout_$a"
  done
  python train.py "${c[@]}" attention=sdpa out_dir="$OUT/compare_dropout_sdpa_repeat"
  python -m bench.compare "$OUT"/compare_dropout_sdpa "$OUT"/compare_dropout_flash "$OUT"/compare_dropout_naive \
    "$OUT"/compare_dropout_sdpa_repeat --window 20 --out "$OUT/compare_dropout.png" --json "$OUT/compare_dropout.json" ;;
sweep)  # context-length sweep, 100 steps each, eager (compile time would dominate 15 short runs)
  python train.py -m experiment=context_sweep attention=naive,sdpa,flash seq_len=1024,2048,4096,8192,16384 \
    compile=false batch.tokens_per_step=16384 "${common[@]}" hydra.sweep.dir="$OUT/sweep"
  python -m bench.report "$OUT/sweep" --out "$OUT/sweep" ;;
preempt)  # flash at seq_len 8192: SIGTERM mid-way, resume, compare with an uninterrupted run
  args=(experiment=gpt2_shakespeare attention=flash seq_len=8192 max_steps=60 compile=false deterministic=true
        batch.tokens_per_step=16384 log_interval=1 eval.interval=0 eval.batches=2 checkpoint.interval=0
        "${common[@]}")
  python train.py "${args[@]}" out_dir="$OUT/preempt_full"
  python train.py "${args[@]}" out_dir="$OUT/preempt_killed" & pid=$!
  for _ in $(seq 600); do  # wait until step 25 is logged, then SIGTERM
    grep -q '"step": 25,' "$OUT/preempt_killed/metrics.jsonl" 2>/dev/null && break; sleep 0.2; done
  kill -TERM $pid; wait $pid; echo "killed run exit code: $?"
  python train.py "${args[@]}" out_dir="$OUT/preempt_killed" resume=true
  python -m bench.compare "$OUT/preempt_full" "$OUT/preempt_killed" --window 1 --tolerance 0 \
    --out "$OUT/preempt.png" --json "$OUT/preempt.json" ;;
window_ablation)  # issue 16: sliding window w = none / 256 / 1024 at seq_len 4096, 500 steps from one seed, flash
  # (a Hydra multirun, as a researcher would run the ablation), then the loss curves against the full-causal run
  python train.py -m experiment=gpt2_shakespeare attention=flash attention.window=null,256,1024 seq_len=4096 \
    max_steps=500 compile=false batch.tokens_per_step=16384 log_interval=1 eval.interval=100 eval.batches=10 \
    checkpoint.interval=0 checkpoint.at_end=false wandb.group=window_ablation_n4096 "${common[@]}" \
    hydra.sweep.dir="$OUT/window_ablation"
  python -m bench.compare "$OUT"/window_ablation/0_* "$OUT"/window_ablation/1_* "$OUT"/window_ablation/2_* \
    --window 20 --out "$OUT/window_ablation.png" --json "$OUT/window_ablation.json"
  python -m bench.report "$OUT/window_ablation" --out "$OUT/window_ablation" ;;  # val loss, tokens/sec per run
multigpu)  # needs 2 GPUs (NGPU=2 by default): 1 GPU vs torchrun ddp vs torchrun fsdp, flash and sdpa at seq_len 8192,
  # the same global batch (65,536 tokens = 8 sequences; micro-batch 4 sequences everywhere: 1 GPU accumulates 2,
  # each of 2 ranks 1), so the data are the same windows and the losses comparable. Then loss curves
  # (bench.compare, per backend, against the 1-GPU run) and tokens/sec, MFU, peak memory (bench.report) into
  # $OUT/multigpu; tokens/sec of a torchrun run is over all its GPUs (MFU per GPU).
  n=${NGPU:-2}
  m=(experiment=gpt2_shakespeare seq_len=8192 max_steps=200 batch.tokens_per_step=65536 batch.micro_batch_size=4
     log_interval=1 eval.interval=100 eval.batches=8 checkpoint.interval=0 wandb.group=multigpu_n8192 "${common[@]}")
  for a in flash sdpa; do
    python train.py "${m[@]}" attention=$a out_dir="$OUT/multigpu/1gpu_$a" || echo "MULTIGPU FAILED: 1gpu $a"
    torchrun --standalone --nproc_per_node="$n" train.py "${m[@]}" attention=$a parallel=ddp \
      out_dir="$OUT/multigpu/${n}gpu_ddp_$a" || echo "MULTIGPU FAILED: ddp $a"
    torchrun --standalone --nproc_per_node="$n" train.py "${m[@]}" attention=$a parallel=fsdp \
      out_dir="$OUT/multigpu/${n}gpu_fsdp_$a" || echo "MULTIGPU FAILED: fsdp $a"
    python -m bench.compare "$OUT/multigpu/1gpu_$a" "$OUT/multigpu/${n}gpu_ddp_$a" "$OUT/multigpu/${n}gpu_fsdp_$a" \
      --window 20 --out "$OUT/multigpu/compare_$a.png" --json "$OUT/multigpu/compare_$a.json"
  done
  python -m bench.report "$OUT/multigpu" --out "$OUT/multigpu"
  # a copy of the fsdp run resumed on one GPU (another world size) for 10 more steps: its DCP checkpoint loads
  rm -rf "$OUT/multigpu_resume_1gpu" && cp -r "$OUT/multigpu/${n}gpu_fsdp_flash" "$OUT/multigpu_resume_1gpu"
  python train.py "${m[@]}" attention=flash parallel=fsdp max_steps=210 resume=true \
    out_dir="$OUT/multigpu_resume_1gpu" || echo "MULTIGPU FAILED: fsdp resume on 1 GPU" ;;
peer)  # ours (attention=flash) beside nanoGPT's train.py ($NANOGPT) at SEQ_LENS (default 1024,8192), BIAS=on|off|both
  # (cells of about 70 s each), then both models alone (bench.peer --models) at the same lengths
  python -m bench.peer --peer "${NANOGPT:?set NANOGPT=path/to/nanoGPT/train.py}" --seq-lens "${SEQ_LENS:-1024,8192}" \
    --bias "${BIAS:-both}" --steps 24 --warmup 8 --out "$OUT/peer_${TAG:-$(gpu_tag)}_${SEQ_LENS:-1024,8192}_bias_${BIAS:-both}" \
    --runs-dir "$OUT/peer_runs" -- data.source="$SRC" ;;
peer_models)  # both models alone in one process, timed and profiled (BIAS, SEQ_LENS as for peer)
  python -m bench.peer --models --peer "${NANOGPT:?set NANOGPT=path/to/nanoGPT/train.py}" \
    --seq-lens "${SEQ_LENS:-1024,8192}" --bias "${BIAS:-both}" --steps 20 --warmup 6 --top 22 ;;
vs_old)  # the default command (flash) in OLD (a checkout of an earlier commit) and in this tree, alternating
  # old, new, new, old per length at SEQ_LENS (default 1024,8192): a change's training speed in one invocation
  o=$(cd "$OUT" && pwd); src=$(cd "$(dirname "$SRC")" && pwd)/$(basename "$SRC")
  sl=${SEQ_LENS:-1024,8192}
  for n in ${sl//,/ }; do i=0; for t in old new new old; do i=$((i+1))
    d=.; [ $t = old ] && d=${OLD:?set OLD=path/to/old/checkout}
    (cd "$d" && python -m bench.throughput --backends flash --seq-lens $n --steps 16 --warmup 6 --profile-steps 0 \
      --out "$o/vs_old_${n}_${i}_$t" --runs-dir "$o/vs_old_runs" -- data.source="$src")
  done; done ;;
fused_loss)  # the default command (flash) with FLASHGPT_FUSED_LOSS=0 and 1 alternating (0, 1, 1, 0) per length at
  # SEQ_LENS (default 1024,8192): the fused classifier loss against F.cross_entropy (bench/NOTES.md)
  o=$(cd "$OUT" && pwd); sl=${SEQ_LENS:-1024,8192}
  for n in ${sl//,/ }; do i=0; for f in 0 1 1 0; do i=$((i+1))
    FLASHGPT_FUSED_LOSS=$f python -m bench.throughput --backends flash --seq-lens $n --steps 16 --warmup 6 \
      --profile-steps 0 --out "$o/fused_loss_${n}_${i}_$f" --runs-dir "$o/fused_loss_runs" -- data.source="$SRC"
  done; done ;;
softcap)  # the kernel cost of soft-capping: flash with c = 30 against plain causal, N = 4k-16k, d = 64 and 128
  for cap in "" 30; do
    python -m bench.attention --providers flash,flex --seqlens 4096,8192,16384 --headdims 64,128 \
      --out "$OUT" --tag h200_causal ${cap:+--softcap $cap}
  done ;;
softcap_triton)  # the cap's own cost: capped vs uncapped, both on the Triton kernels (the Gluon ones take no cap)
  for cap in "" 30; do
    FLASHGPT_GLUON_FWD=0 FLASHGPT_GLUON_BWD=0 python -m bench.attention --providers flash --seqlens 4096,8192,16384 \
      --headdims 64,128 --modes fwd,bwd --out "$OUT" --tag h200_triton_causal ${cap:+--softcap $cap}
  done ;;
gqa)  # training throughput with n_kv_head = 12 / 4 / 1 at seq_len 8192 (flash)
  for kv in 12 4 1; do
    python -m bench.throughput --backends flash --seq-lens 8192 --steps 16 --warmup 6 --profile-steps 0 \
      --out "$OUT/throughput_h200_gqa$kv" --runs-dir "$OUT/throughput_runs" -- data.source="$SRC" model.n_kv_head=$kv
  done ;;
ablations)  # one Hydra multirun per ablation on the code corpus, 200 steps at seq_len 1024 from one seed, then
  # loss curves (bench.compare against the first run) and the sweep table (bench.report)
  code_corpus
  a=(-m attention=flash seq_len=1024 max_steps=200 batch.tokens_per_step=16384 compile=false log_interval=1
     eval.interval=100 eval.batches=10 checkpoint.interval=0 checkpoint.at_end=false "${code[@]}")
  python train.py "${a[@]}" model.pos_emb=learned,rope model.qk_norm=false,true wandb.group=ablate_pos_qk \
    hydra.sweep.dir="$OUT/ablate_pos_qk"
  python train.py "${a[@]}" model.n_kv_head=12,4,1 wandb.group=ablate_kv hydra.sweep.dir="$OUT/ablate_kv"
  for s in ablate_pos_qk ablate_kv; do
    python -m bench.compare "$OUT/$s"/[0-9]* --window 20 --out "$OUT/$s.png" --json "$OUT/$s.json"
    python -m bench.report "$OUT/$s" --out "$OUT/$s"
  done ;;
context)  # loss by context length on the code corpus: seq_len 1024 / 4096 / 16384, the same 32,768 tokens per
  # step and 200 steps (6.6M tokens) from one seed, flash, eager
  code_corpus
  python train.py -m attention=flash seq_len=1024,4096,16384 max_steps=200 batch.tokens_per_step=32768 \
    compile=false log_interval=1 eval.interval=100 \
    eval.batches=10 checkpoint.interval=0 checkpoint.at_end=false wandb.group=context_code "${code[@]}" \
    hydra.sweep.dir="$OUT/context"
  python -m bench.compare "$OUT/context"/[0-9]* --window 20 --out "$OUT/context.png" --json "$OUT/context.json"
  python -m bench.report "$OUT/context" --out "$OUT/context" ;;
redesign)  # bench.attention, this tree against OLD (a checkout of the tree before the redesign, 3f1c827), the
  # two trees in turn per N in one invocation (bench/results/redesign_h200.md)
  o=$(cd "$OUT" && pwd)
  for n in 1024 8192; do for t in old new; do
    d=.; [ $t = old ] && d=${OLD:?set OLD=path/to/old/checkout}
    (cd "$d" && python -m bench.attention --seqlens $n --headdims 64,128 --providers flash,sdpa-cudnn \
      --modes fwd,bwd,fwdbwd --out "$o/redesign_$t" --tag n$n)
  done; done ;;
*) echo "unknown phase $PHASE"; exit 2 ;;
esac
