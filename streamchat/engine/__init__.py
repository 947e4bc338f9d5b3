"""The engine: every conversation's next forward pass, scheduled and run as one step."""
