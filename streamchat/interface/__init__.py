"""What the app and the bench share: the options they take, their configuration, and what reaches the
terminal (error reports, safe text, tables, signals, the live cache display, piped transcripts).

Below the app and the bench, above the engine: it renders the engine's events and imports neither of them.
"""
