"""The small Llama as a 1F1B pipeline of tensor-parallel stages.

Stage ``p`` of ``pp`` holds decoder layers ``[p L/pp, (p+1) L/pp)``
(:func:`stage_names`); the first stage also the embedding, the last the final
norm and the output layer. Each sequence is one micro-batch; the stages run
:func:`simcomm.parallel.pipeline.schedule`'s ``"1f1b"`` order. Between stages
the sequence-parallel shard ``(s/t, h)`` (``(s/(cp t), h)`` with a context
group of ``cp`` ranks) goes from tensor rank ``t`` of one stage to tensor rank
``t`` of the next (``isend`` forward, the gradient back the same way; receives
block), so the activations crossing a stage boundary are ``1/t`` of the
sequence (or of the context chunk).

:func:`stage_step` is one step's forward and backward on one rank; the
gradients accumulate in the stage's shards (``.grad``).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..communicator import Communicator
from . import llama
from ..parallel.pipeline import schedule

__all__ = ["stage_names", "stage_step"]


def stage_names(config: llama.Config, stage: int, stages: int) -> list[str]:
    """The parameter names stage ``stage`` of ``stages`` holds."""
    if config.layers % stages:
        raise ValueError(f"llama_pipeline: layers={config.layers} is not divisible by pp={stages}")
    per = config.layers // stages
    names = [n for layer in range(stage * per, (stage + 1) * per) for n in llama.layer_names(layer)]
    if stage == 0:
        names = ["embed", *names]
    if stage == stages - 1:
        names = [*names, "final_norm", "output"]
    return names


def stage_step(pipe: Communicator, tensor: Communicator, sequences: list[torch.Tensor],
               shards: dict[str, torch.Tensor] | Callable[[], dict[str, torch.Tensor]], config: llama.Config,
               global_batch: int, context: Communicator | None = None) -> torch.Tensor:
    """Forward and backward of every sequence (micro-batch) in 1F1B order on this stage
    (``pipe.rank`` of ``pipe.world_size``); ``shards`` this rank's tensor shards of
    :func:`stage_names`, or a function returning them, called before each micro-batch's forward
    (FSDP: :func:`simcomm.parallel.llama_fsdp.unshard`, whose backward reduce-scatters into the
    pieces). With a ``context`` group each rank runs its chunk of every sequence
    (:func:`simcomm.models.llama.context_chunk`; the keys and values all-gathered over
    ``context``) and its loss is that chunk's part. Returns the summed loss of the micro-batches
    (each ``/ global_batch``) on the last stage, zero elsewhere. Gradients accumulate in the
    leaves' ``.grad``. Collective over ``pipe``, ``tensor`` (and ``context``); blocks."""
    stages, stage = pipe.world_size, pipe.rank
    per = config.layers // stages
    first, last = stage == 0, stage == stages - 1
    seq = sequences[0].shape[0] - 1
    saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
    sends, total = [], torch.zeros((), dtype=torch.float64)
    for kind, index in schedule("1f1b", stages, len(sequences))[stage]:
        if kind == "F":
            params = shards() if callable(shards) else shards
            inputs, targets, positions = llama.context_chunk(sequences[index], context, "llama_pipeline.stage_step")
            if first:
                inp, x = None, llama.embed(tensor, inputs, params, config)               # (s/(cp t), h)
            else:
                shard_shape = (inputs.shape[0] // tensor.world_size, config.hidden)       # (s/(cp t), h)
                inp = pipe.recv(shard_shape, next(iter(params.values())).dtype, src=stage - 1).requires_grad_()
                x = inp
            for layer in range(stage * per, (stage + 1) * per):
                x = llama.block(tensor, x, params, config, layer, positions, context)
            if last:
                x = llama.head(tensor, x, targets, params, config, seq) / global_batch
                total = total + x.detach().double()
            else:
                sends.append(pipe.isend(x.detach(), stage + 1))
            saved[index] = (inp, x)
        else:
            inp, out = saved.pop(index)
            if last:
                out.backward()
            else:
                out.backward(pipe.recv(out.shape, out.dtype, src=stage + 1))
            if not first:
                sends.append(pipe.isend(inp.grad, stage - 1))
    for handle in sends:
        handle.wait()
    return total
