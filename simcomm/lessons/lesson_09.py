"""Lesson 09 (Context parallelism): its exercise checkers, written here, and the assertion helpers it uses.

A lesson imports this one module, ``import simcomm.lessons.lesson_09 as check``, and calls
``check.check_...`` and ``check.assert_close(...)``. The assertion helpers are written in
:mod:`simcomm.lessons.asserts`, the wording of every verdict and what every checker shares in
:mod:`simcomm.lessons.verdicts`. Every checker *returns* its verdict and never raises for what the
learner wrote; the programs it runs go to the simulator (``World``), whatever the backend the lesson
uses: an exercise checks understanding, and a deadlocking answer must fail at once.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..parallel.context import block_attention, chunk_ids, lse_merge, shard_sequence
from .asserts import assert_close, expect_error, gradcheck_across_ranks, max_error, per_rank
from .verdicts import NOT_ANSWERED, is_correct, is_placeholder
from .verdicts import as_ints as _as_ints
from .verdicts import called as _call
from .verdicts import helper_verdict as _helper_verdict
from .verdicts import hint_on_request as _hint_on_request
from .verdicts import not_yet as _not_yet
from .verdicts import uses_helper as _uses_helper

__all__ = ['NOT_ANSWERED', 'is_correct', 'per_rank', 'max_error', 'assert_close', 'expect_error', 'gradcheck_across_ranks', 'check_lse_merge', 'check_zigzag_chunks']


def _blocks(seed: int, split: int, keys: int = 6):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 3, 2, 4, generator=gen, dtype=torch.float64) if i == 0 else
               torch.randn(1, keys, 2, 4, generator=gen, dtype=torch.float64) for i in range(3))
    whole = block_attention(q, k, v)
    return block_attention(q, k[:, :split], v[:, :split]), block_attention(q, k[:, split:], v[:, split:]), whole


@_hint_on_request
def check_lse_merge(merge: Callable) -> str:
    """``merge(out1, lse1, out2, lse2) -> (out, lse)``: attention over two key blocks from each block's
    output ``(b, sq, h, d)`` and log-sum-exp ``(b, sq, h)``."""
    if is_placeholder(merge):
        return NOT_ANSWERED
    if not callable(merge):
        return _not_yet("merge must be a function merge(out1, lse1, out2, lse2) returning (out, lse)")
    helper = lse_merge if merge is lse_merge else _uses_helper(merge, lse_merge)
    if helper is not None:
        return _helper_verdict(helper, "the merge")
    cases = 0
    for seed, split in ((0, 2), (1, 5), (2, 1)):
        (out1, lse1), (out2, lse2), (out, lse) = _blocks(seed, split)
        result, verdict = _call(merge, out1, lse1, out2, lse2)
        if verdict:
            return verdict
        if not isinstance(result, tuple) or len(result) != 2 or not all(isinstance(t, torch.Tensor) for t in result):
            return _not_yet("return a pair (out, lse) of tensors; the lse is needed to merge the next block "
                            f"(got {type(result).__name__})")
        got_out, got_lse = result
        if got_out.shape != out.shape or got_lse.shape != lse.shape:
            return _not_yet(f"shapes {tuple(got_out.shape)} and {tuple(got_lse.shape)}; expected out "
                            f"{tuple(out.shape)} and lse {tuple(lse.shape)} (the inputs' shapes)")
        lse_ok = torch.allclose(got_lse, lse, atol=1e-10)
        out_ok = torch.allclose(got_out, out, atol=1e-10)
        if out_ok and not lse_ok:
            return _not_yet("the output is right but the lse is not",
                            "the merged lse is log(exp(lse1) + exp(lse2)), computed without overflow")
        if lse_ok and not out_ok:
            return _not_yet("the lse is right but the output is not", "weigh each block's output by "
                            "exp(lse_i - lse), its share of the whole softmax denominator")
        if not out_ok:
            return _not_yet("out and lse both differ from attention over both blocks", "each block's output is "
                            "normalised by its own sum exp(lse_i); renormalise both to the common sum")
        cases += 1
    (out1, lse1), (out2, lse2), (out, lse) = _blocks(4, 3)
    shift = 100.0 - float(torch.maximum(lse1, lse2).max())       # logits this large: lse up to 100
    large = [t.float() for t in (out1, lse1 + shift, out2, lse2 + shift)]
    result, verdict = _call(merge, *large)
    if verdict:
        return verdict
    if (not isinstance(result, tuple) or len(result) != 2 or not all(isinstance(t, torch.Tensor) for t in result)
            or not torch.isfinite(result[0]).all() or not torch.isfinite(result[1]).all()
            or not torch.allclose(result[0].double(), out, atol=1e-5)
            or not torch.allclose(result[1].double(), lse + shift, atol=1e-4)):
        return _not_yet("in float32 with large logits (lse up to 100) your merge is not finite or not right: "
                        "exp(100) overflows float32 (its largest value is about exp(88.7))",
                        "never exponentiate an lse itself: torch.logaddexp(lse1, lse2), or the larger lse plus "
                        "log1p(exp(smaller - larger)), stays finite")
    (out2, lse2) = _blocks(3, 2)[1]
    empty = torch.full_like(lse2, float("-inf"))
    result, verdict = _call(merge, torch.zeros_like(out2), empty, out2, lse2)
    if verdict:
        return verdict
    if (not isinstance(result, tuple) or len(result) != 2 or not torch.allclose(result[0], out2, atol=1e-12)
            or not torch.allclose(result[1], lse2, atol=1e-12)):
        return _not_yet("merging with an empty block (out 0, lse -inf), the start of the ring, must give the "
                        "other block unchanged", "torch.logaddexp handles -inf; lse1 + log1p(exp(lse2 - lse1)) "
                        "gives nan when lse1 is -inf")
    return (f"Correct: {cases} pairs of blocks merge to attention over both, large logits stay finite in float32, "
            "and an empty block changes nothing.")


@_hint_on_request
def check_zigzag_chunks(chunks: Callable) -> str:
    """``chunks(rank, world_size) -> [i, j]``: the two of the ``2P`` chunks rank holds in zig-zag sharding
    (a list, tuple, set, array or tensor of two whole numbers of any numeric type, in any order)."""
    if is_placeholder(chunks):
        return NOT_ANSWERED
    helper = chunk_ids if chunks is chunk_ids else _uses_helper(chunks, chunk_ids, shard_sequence)
    if helper is not None:
        return _helper_verdict(helper, "the chunks of each rank")
    for world_size in (1, 2, 3, 4, 8):
        held = []
        for rank in range(world_size):
            result, verdict = _call(chunks, rank, world_size)
            if verdict:
                return verdict
            ids = _as_ints(sorted(result, key=repr) if isinstance(result, (set, frozenset)) else result)
            if ids is None or len(ids) != 2:
                return _not_yet(f"chunks({rank}, {world_size}) returned {result!r}; return a list of two chunk "
                                "indices (whole numbers)")
            held.append(sorted(ids))
        flat = sorted(i for ids in held for i in ids)
        if flat != list(range(2 * world_size)):
            return _not_yet(f"with {world_size} ranks the chunks held are {held}; every one of the "
                            f"{2 * world_size} chunks must be held by exactly one rank")
        work = [sum(q + 1 for q in ids) for ids in held]        # key chunks at or before each query chunk
        if len(set(work)) != 1:
            return _not_yet(f"with {world_size} ranks your chunks give causal work (key chunks at or before "
                            f"each query chunk) {work} per rank: not balanced",
                            "pair a chunk from the head with one from the tail")
    return ("Correct: balanced chunks for 1 to 8 ranks: every rank does the same causal work, 2P + 1 "
            "blocks (zig-zag: one chunk from the head, one from the tail).")
