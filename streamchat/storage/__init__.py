"""Conversations on disk: the journal, saved session files, cache state files; each written from values."""
