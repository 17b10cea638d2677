"""Schedules for variable-cost micro-batches: compute orders, simulation, lowering to per-rank
instruction lists, validation and timelines. Pure Python/numpy: no torch.distributed here."""
