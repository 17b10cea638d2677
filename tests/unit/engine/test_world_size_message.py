"""A world size that does not factor says which options to change: ``torchrun --nproc-per-node 2 -m dynabatch train``
without ``--stages 2`` named only the internal ``num_stages``/``num_replicas``."""
import pytest

from dynabatch.engine.dist import check_world


def test_a_world_size_that_does_not_factor_names_the_options_to_change():
    with pytest.raises(ValueError) as e:
        check_world(2, 1, 1)
    message = str(e.value)
    assert message.startswith("world size 2 != num_stages 1 x num_replicas 1 (= 1)")
    assert "--stages" in message and "--replicas" in message and "--nproc-per-node 2" in message
