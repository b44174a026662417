"""Lesson 03 (The ring all-reduce and its cost): its exercise checkers and the assertion helpers it uses.

A lesson imports this one module, ``import simcomm.lessons.lesson_03 as check``, and calls
``check.check_...`` and ``check.assert_close(...)``. The checkers are written in
:mod:`simcomm.lessons.foundations` (with the other lessons of its group, which share their programs);
the assertion helpers in :mod:`simcomm.lessons.asserts`; the wording of every verdict in
:mod:`simcomm.lessons.verdicts`.
"""
from __future__ import annotations

from .asserts import assert_close, expect_error, gradcheck_across_ranks, max_error, per_rank
from .foundations import check_ring_all_gather, ring_all_reduce, ring_exchange, ring_schedule
from .verdicts import NOT_ANSWERED, is_correct

__all__ = ['NOT_ANSWERED', 'is_correct', 'per_rank', 'max_error', 'assert_close', 'expect_error', 'gradcheck_across_ranks', 'check_ring_all_gather', 'ring_all_reduce', 'ring_exchange', 'ring_schedule']
