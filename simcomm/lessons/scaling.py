"""Lessons 09-12's checkers under one name, for the code that imports them from here (the tests of
these checkers). Each is written in its lesson's module, :mod:`simcomm.lessons.lesson_09` to
:mod:`simcomm.lessons.lesson_12`. A lesson imports its own module:
``import simcomm.lessons.lesson_NN as check``.
"""
from __future__ import annotations

from .lesson_09 import check_lse_merge, check_zigzag_chunks
from .lesson_10 import check_aux_loss, check_dropped, check_split_sizes
from .lesson_11 import EXCHANGE_TIMEOUT_S, check_neighbour_exchange, check_sp_layernorm
from .lesson_12 import LAYOUT_EXERCISE, check_layout_choice, check_mesh_coords
from .verdicts import NOT_ANSWERED, is_correct

__all__ = ["NOT_ANSWERED", "is_correct", "check_lse_merge", "check_zigzag_chunks", "check_split_sizes",
           "check_dropped", "check_aux_loss", "check_neighbour_exchange", "check_sp_layernorm", "check_mesh_coords",
           "check_layout_choice", "EXCHANGE_TIMEOUT_S", "LAYOUT_EXERCISE"]
