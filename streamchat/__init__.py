"""streamchat: endless terminal chat through a sink-preserving rolling KV cache."""

__version__ = "0.1.0"
