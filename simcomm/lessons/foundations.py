"""Lessons 00-05's checkers and helpers under one name, for the code that imports them from here (the
tests of these checkers). Each is written in its lesson's module, :mod:`simcomm.lessons.lesson_00`
to :mod:`simcomm.lessons.lesson_05`; the assertion helpers in :mod:`simcomm.lessons.asserts`. A lesson
imports its own module: ``import simcomm.lessons.lesson_NN as check``.
"""
from __future__ import annotations

from .asserts import assert_close, expect_error, gradcheck_across_ranks, max_error, per_rank
from .lesson_00 import check_count_ranks, check_deadlocks
from .lesson_01 import PREDICTED_OPS, check_prediction, check_shapes
from .lesson_02 import check_all_gather_backward
from .lesson_03 import check_ring_all_gather, ring_all_reduce, ring_exchange, ring_schedule
from .lesson_04 import check_tp_mlp
from .lesson_05 import check_ulysses_gqa_bytes
from .verdicts import NOT_ANSWERED, is_correct

__all__ = [
    "per_rank", "max_error", "assert_close", "expect_error", "gradcheck_across_ranks",
    "ring_all_reduce", "ring_schedule", "ring_exchange", "NOT_ANSWERED", "is_correct", "PREDICTED_OPS",
    "check_prediction", "check_count_ranks", "check_deadlocks", "check_shapes", "check_all_gather_backward",
    "check_ring_all_gather", "check_tp_mlp", "check_ulysses_gqa_bytes",
]
