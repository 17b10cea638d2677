from dynabatch.core.words import counted


def test_counted_is_singular_for_one_and_plural_otherwise():
    """The commands' lines say ``1 measured step`` and ``2 sources`` (bench's tuning line said ``1 measured steps``)."""
    assert counted(1, "measured step") == "1 measured step"
    assert counted(0, "source") == "0 sources" and counted(2, "source") == "2 sources"
