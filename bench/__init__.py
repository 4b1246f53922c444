"""flashgpt's benchmarks and run analysis, one tool per study (``python -m bench.<name> --help``):

    attention   causal attention kernels: ours, naive, SDPA backends, FlexAttention (TFLOP/s, memory, check)
    throughput  training tokens/sec, MFU, memory and GPU busy of ``train.py`` per backend and seq_len;
                ``--gaps``: where the GPU waits in a ``perf.trace=true`` trace
    peer        our default training command beside a peer's train.py (nanoGPT's), same model and tokens
    decode      KV-cache decode step (flash-decoding vs SDPA) and end-to-end generation tokens/sec
    variants    sliding window and document masks against full causal and FlexAttention
    tune        tile search and interleaved A/B of our kernels' tiles; ``--decode``: flash-decode tile search
    compare     loss curves of runs against the first one: differences, tolerances, PNG
    report      one table and figure for a sweep (``train.py -m``)

The GPU tools take ``--dry-run`` (a CPU check of the plumbing); compare and report read run directories on any
machine. ``common`` holds what they share; ``h200_runs.sh`` the H200 runs behind ``results/`` (index:
``results/README.md``); ``NOTES.md`` is the kernel work log.
"""
