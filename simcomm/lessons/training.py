"""Lessons 06-08's checkers under one name, for the code that imports them from here (the tests of
these checkers, :func:`~simcomm.lessons.lesson_08.schedule_makespan` for the pipeline tests). Each is written in its lesson's
module, :mod:`simcomm.lessons.lesson_06` to :mod:`simcomm.lessons.lesson_08`. A lesson imports its own
module: ``import simcomm.lessons.lesson_NN as check``.
"""
from __future__ import annotations

from .lesson_06 import ACCUMULATION_EXERCISE, check_accumulation_step, check_dp_step
from .lesson_07 import ZERO3_EXERCISE, check_zero2_grads, check_zero3_bytes
from .lesson_08 import BUBBLE_EXERCISE, check_1f1b, check_bubble, check_zero_bubble, schedule_makespan
from .verdicts import NOT_ANSWERED, is_correct

__all__ = ["NOT_ANSWERED", "is_correct", "check_dp_step", "check_accumulation_step", "check_zero3_bytes",
           "check_zero2_grads", "check_bubble", "check_1f1b", "check_zero_bubble", "schedule_makespan",
           "ACCUMULATION_EXERCISE", "ZERO3_EXERCISE", "BUBBLE_EXERCISE"]
