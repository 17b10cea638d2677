"""Distributed runtime: process groups (:mod:`.dist`), p2p transfers (:mod:`.p2p`), plan delivery
(:mod:`.delivery`), the instruction executor (:mod:`.executor`) and the step driver (:mod:`.step`).
The only layer of dynabatch that talks to ``torch.distributed``."""
