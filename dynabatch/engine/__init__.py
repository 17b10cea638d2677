"""The pipeline engine: process groups (:mod:`.dist`), p2p transfers (:mod:`.p2p`), plan delivery
(:mod:`.delivery`), the instruction executor (:mod:`.executor`), the step driver (:mod:`.step`), checkpoint I/O
(:mod:`.checkpoint`), ZeRO sharding across replicas (:mod:`.zero`) and launching (:mod:`.launch`).

It runs the per-rank instruction lists the ``plan`` and ``schedule`` layers produce and knows nothing of the
training application (:mod:`dynabatch.training`) built on it: ``examples/engine_only.py`` runs a step of
variable-shape micro-batches with the engine alone. With the application, the only parts of dynabatch that talk to
``torch.distributed``."""
