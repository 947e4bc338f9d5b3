"""streamchat: endless terminal chat through a sink-preserving rolling KV cache."""

import logging

__version__ = "0.1.0"

# transformers imports torchao whenever it is installed, and torchao's import warns that a CPU
# build of torch cannot load its CUDA extensions (and torch that torchao registers an enum the
# old way): lines a user can do nothing about. Real errors still show.
for _noisy in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)
