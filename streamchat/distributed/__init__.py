"""Tensor parallelism: one conversation run by N processes in lockstep (`--tp`).

    group.py       who this process is (torchrun's environment), the process groups, their timeouts
    lockstep.py    rank 0's requests to the others, and the token (or stop) of every step
    leader.py      rank 0's session: each call that moves the conversation goes to every rank first
    follower.py    the other ranks: rank 0's moves applied to their session, no terminal
    supervisor.py  `streamchat run --tp N`: start N local ranks, and end them all when one ends

The engine knows only `generation.decoder.LockstepChannel`; the app wires the rest (app/tensor_parallel.py).
"""
