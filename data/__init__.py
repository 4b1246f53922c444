"""Data step: a corpus -> token shards + meta.json (``data.prepare``), served as deterministic batches
(``data.loader``). Nothing is re-exported, so ``python -m data.prepare`` imports ``data.prepare`` once."""
