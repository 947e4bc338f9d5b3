"""The conversation: one ChatSession per conversation, its chat format and what it keeps, as a value it can be
snapshotted to and restored from (state.py). No file I/O: storage/ reads and writes those values."""
