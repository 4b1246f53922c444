"""Data step: turn a UTF-8 text corpus into uint16 token files and serve deterministic batches.

Modules (imported explicitly, nothing is re-exported here so that ``python -m data.prepare``
does not import ``data.prepare`` twice):

- ``data.prepare``: ``prepare`` / ``ensure_prepared`` and the CLI
  (``python -m data.prepare --source PATH --out-dir DIR --tokenizer gpt2|char``).
- ``data.loader``: ``load_meta``, ``tokenizer_from_meta``, ``BinDataset``.
- ``data.tokenizer``: the GPT-2 BPE (tiktoken) and character-level tokenizers.
- ``data.meta``: the on-disk format (``meta.json`` + ``train.bin`` / ``val.bin``) and its checks.
"""
