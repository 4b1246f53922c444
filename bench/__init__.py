"""flashgpt's benchmark and run-analysis tool. Each module is a CLI (``python -m bench.<name> --help``):

Benchmarks (GPU; ``--dry-run`` checks the plumbing on a CPU where it applies):
    attention   causal attention kernels: ours, naive, SDPA backends, FlexAttention (TFLOP/s, memory, check)
    throughput  training tokens/sec, MFU, memory and GPU busy of ``train.py`` per backend and seq_len
    decode      KV-cache decode step (flash-decoding vs SDPA) and end-to-end generation tokens/sec
    decode_tiles  flash-decode split kernel's BLOCK_N x splits x warps x stages, against the automatic choice
    tune        tile search for our kernels, and interleaved A/B timing of tile plans (``--plans``)
    variants    sliding window and document masks against full causal and FlexAttention

Run analysis (any machine; reads run directories written by ``train.py``):
    compare     loss curves of runs against the first one: differences, tolerances, PNG
    report      one table and figure for a sweep (``train.py -m``)
    trace_gaps  where the GPU waits in a ``perf.trace=true`` trace: idle gaps by host context

Shared, not run directly: ``_providers`` (attention providers and the float32 reference), ``_timing``
(median timer, failure status), ``_attention_report`` (tables and plots of ``attention``), ``_rundir``
(reading run directories), ``_plot`` (matplotlib helpers). ``h200_runs.sh`` holds the H200 runs whose
results are in ``results/`` (index: ``results/README.md``); ``NOTES.md`` the kernel work log.
"""
