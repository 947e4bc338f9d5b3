"""What reaches the terminal, shared by the chat and the benchmarks: error reports, safe text, tables, signals,
the live cache display and piped transcripts. Imports the engine's events, never the app or the bench."""
