"""Lesson 09 (Context parallelism): its exercise checkers and the assertion helpers it uses.

A lesson imports this one module, ``import simcomm.lessons.lesson_09 as check``, and calls
``check.check_...`` and ``check.assert_close(...)``. The checkers are written in
:mod:`simcomm.lessons.scaling` (with the other lessons of its group, which share their programs);
the assertion helpers in :mod:`simcomm.lessons.asserts`; the wording of every verdict in
:mod:`simcomm.lessons.verdicts`.
"""
from __future__ import annotations

from .asserts import assert_close, expect_error, gradcheck_across_ranks, max_error, per_rank
from .scaling import check_lse_merge, check_zigzag_chunks
from .verdicts import NOT_ANSWERED, is_correct

__all__ = ['NOT_ANSWERED', 'is_correct', 'per_rank', 'max_error', 'assert_close', 'expect_error', 'gradcheck_across_ranks', 'check_lse_merge', 'check_zigzag_chunks']
