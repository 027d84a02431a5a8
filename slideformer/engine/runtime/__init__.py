"""The sliding-window runtime: backends, slot pool, host state, CPU AdamW, executor."""
