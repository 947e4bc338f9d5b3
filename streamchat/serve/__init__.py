"""`streamchat serve`: endless conversations over an OpenAI-compatible HTTP API."""
