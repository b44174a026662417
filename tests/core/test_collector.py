"""simcomm.collector: full garbage collections held off for a block, the thresholds given back."""
from __future__ import annotations

import gc

import pytest

from simcomm.collector import DEFERRED_FULL_COLLECTIONS, FullCollectionsDeferred


@pytest.fixture(autouse=True)
def thresholds():
    saved = gc.get_threshold()
    yield saved
    gc.set_threshold(*saved)


def test_a_block_raises_only_the_oldest_generations_threshold_and_gives_the_old_ones_back(thresholds):
    gc.set_threshold(500, 7, 3)
    with FullCollectionsDeferred():
        assert gc.get_threshold() == (500, 7, DEFERRED_FULL_COLLECTIONS)
    assert gc.get_threshold() == (500, 7, 3)
    with pytest.raises(KeyError):
        with FullCollectionsDeferred():
            raise KeyError("inside")
    assert gc.get_threshold() == (500, 7, 3)


def test_blocks_nest_and_an_inactive_block_leaves_the_thresholds_alone():
    gc.set_threshold(700, 10, 10)
    with FullCollectionsDeferred():
        with FullCollectionsDeferred():
            assert gc.get_threshold() == (700, 10, DEFERRED_FULL_COLLECTIONS)
        assert gc.get_threshold() == (700, 10, DEFERRED_FULL_COLLECTIONS), "the inner block kept the outer's"
    assert gc.get_threshold() == (700, 10, 10)
    with FullCollectionsDeferred(active=False):
        assert gc.get_threshold() == (700, 10, 10)
    # a threshold already above the deferred one stays
    gc.set_threshold(700, 10, 10 * DEFERRED_FULL_COLLECTIONS)
    with FullCollectionsDeferred():
        assert gc.get_threshold()[2] == 10 * DEFERRED_FULL_COLLECTIONS


def test_thresholds_set_inside_the_block_are_kept():
    gc.set_threshold(700, 10, 10)
    with FullCollectionsDeferred():
        gc.set_threshold(100, 5, 5)
    assert gc.get_threshold() == (100, 5, 5)


def test_a_young_block_raises_the_youngest_generations_threshold_too_and_gives_it_back():
    from simcomm.collector import YOUNG_COLLECTIONS

    gc.set_threshold(500, 7, 3)
    with FullCollectionsDeferred(young=True):
        assert gc.get_threshold() == (YOUNG_COLLECTIONS, 7, DEFERRED_FULL_COLLECTIONS)
        with FullCollectionsDeferred():
            assert gc.get_threshold() == (YOUNG_COLLECTIONS, 7, DEFERRED_FULL_COLLECTIONS), "the inner block kept it"
    assert gc.get_threshold() == (500, 7, 3)
    gc.set_threshold(2 * YOUNG_COLLECTIONS, 7, 3)    # a threshold already above it stays
    with FullCollectionsDeferred(young=True):
        assert gc.get_threshold() == (2 * YOUNG_COLLECTIONS, 7, DEFERRED_FULL_COLLECTIONS)
    assert gc.get_threshold() == (2 * YOUNG_COLLECTIONS, 7, 3)
    with FullCollectionsDeferred(active=False, young=True):
        assert gc.get_threshold() == (2 * YOUNG_COLLECTIONS, 7, 3)


def test_cycles_are_still_collected_inside_a_young_block():
    """The young generation still collects, after YOUNG_COLLECTIONS more allocations: garbage
    cycles made inside the block do not pile up without bound."""
    import weakref

    from simcomm.collector import YOUNG_COLLECTIONS

    class Node:
        pass

    gc.collect()
    with FullCollectionsDeferred(young=True):
        first = Node()
        first.me = first                  # a cycle: reference counting never frees it
        alive = weakref.ref(first)
        del first
        for _ in range(3):                # more than a young threshold of containers, then dropped
            keep = [[] for _ in range(YOUNG_COLLECTIONS)]
            del keep
        assert alive() is None
