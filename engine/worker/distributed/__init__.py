"""Tensor parallelism over torch.distributed: one process per rank, the scheduler and KV block manager on rank 0.

Rank 0 is the engine core. It starts ranks 1..N-1 (`launcher.py`, or an outside launcher starts every rank
with torchrun-style MASTER_ADDR / MASTER_PORT / WORLD_SIZE / RANK), meets them through a TCPStore
(`rendezvous.py`) and, every step, broadcasts the step's packed inputs (`commands.py`); each rank runs its
shard of the model (`rank.py`), and rank 0 gathers the logits and samples. Liveness runs beside the
collectives (`liveness.py`): a rank that dies or hangs ends every rank, never leaving one behind.

This package's modules import only torch at the top (the model layers import `group`), so import them by
their full path.
"""
