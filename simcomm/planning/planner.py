"""Plan a cluster: memory per GPU and modelled step time of every 4-D layout of a GPU budget.

For a Llama (:class:`simcomm.models.llama.Config`; the Llama 3 shapes
:data:`~simcomm.models.llama.LLAMA3_8B`, ``LLAMA3_70B``, ``LLAMA3_405B``) on
``gpus = tp * cp * pp * dp`` GPUs, ranks placed on the project's one mesh
(:class:`simcomm.parallel.mesh.Layout`, :func:`mesh`: pipeline outermost,
then data, context and tensor parallelism innermost, ``init_device_mesh``'s
row-major order and torchtitan's; a tensor group is ``tp`` consecutive GPUs,
inside one node when ``tp <= 8``; the Llama 3 paper orders the same
innermost three but puts DP outside PP), :func:`plan` returns one row per
layout with:

* **memory per GPU by label**, on the pipeline stage that needs the most:
  the model states of :func:`simcomm.parallel.mixed_precision.expected_bytes`
  (bf16 parameters, gradients, fp32 master + Adam) for this GPU's share of the
  parameters (``1/tp`` of ``layers/pp`` layers, plus the embedding on the first
  stage and the output layer on the last), sharded over the ``dp * cp`` ranks
  that replicate them as ZeRO ``zero`` shards; and the **activations**: per
  layer the bytes a Llama layer keeps with tensor + sequence and context
  parallelism and flash attention (:func:`layer_activation_bytes`), times the
  layers of the stage, times the micro-batches in flight under 1F1B (the first
  stage holds ``min(pp, m)``), plus the output layer's bf16 and fp32 logits on
  the last stage;
* **the modelled step time**: the step's flops (``6 x parameters x tokens`` plus
  attention, plus a forward again under full recomputation) at the topology's
  peak times ``efficiency``, the 1F1B bubble ``(pp - 1) / m``, the tensor- and
  context-parallel collectives on the critical path
  (:func:`simcomm.model.cost.estimate` with the groups' real GPUs), and the
  data-parallel reduce-scatter + all-gather of the gradients and parameters
  where it exceeds the compute it overlaps.

It is a model, not a measurement: no values are computed, collectives are
modelled (alpha-beta, :mod:`simcomm.model.cost`), kernels run at a stated
fraction of peak, and what the allocator adds (fragmentation, workspace,
caches) is not counted. The shape-only simulator (``World(n, tensors="shape")``)
checks the per-rank accounting on traced programs; this module applies it to
every layout at once, which a shape-only run of each layout at 1024+ ranks
would take minutes per layout on a laptop to do.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ..model.cost import estimate
from ..model.topology import Topology, get_topology
from ..models.llama import LLAMA3_8B, LLAMA3_70B, LLAMA3_405B, Config
from ..parallel.mesh import Layout
from ..parallel.mixed_precision import expected_bytes

__all__ = ["DIMENSIONS", "LABELS", "layouts", "mesh", "plan",
           "memory_per_gpu", "step_time", "layer_activation_bytes", "fastest_fitting", "key", "sized", "GiB",
           "published_layouts"]

GiB = 2 ** 30
#: the order of a layout tuple's sizes (innermost first, as the Llama 3 paper lists them); the ranks'
#: order is the mesh's (:func:`mesh`)
DIMENSIONS = ("tp", "cp", "pp", "dp")
#: the memory labels of a row
LABELS = ("parameters", "gradients", "optimizer_state", "activations")


def key(row: dict) -> tuple[int, int, int, int]:
    """``(tp, cp, pp, dp)`` of a row."""
    return tuple(row[name] for name in DIMENSIONS)


def mesh(layout: tuple[int, int, int, int]) -> Layout:
    """The :class:`~simcomm.parallel.mesh.Layout` of a ``(tp, cp, pp, dp)`` tuple (or a row's
    :func:`key`): where each GPU of the plan sits and which GPUs form each group."""
    if isinstance(layout, Layout):
        return layout
    if not isinstance(layout, tuple) or len(layout) != len(DIMENSIONS):
        raise ValueError(f"planner.mesh: layout={layout!r} must be a (tp, cp, pp, dp) tuple")
    return Layout(**dict(zip(DIMENSIONS, layout)))


def _powers_of_two(limit: int) -> list[int]:
    out, value = [], 1
    while value <= limit:
        out.append(value)
        value *= 2
    return out


def layouts(model: Config, gpus: int, *, global_batch: int, micro_batch: int = 1, max_tp: int = 8,
            max_cp: int = 16, max_pp: int = 16) -> list[tuple[int, int, int, int]]:
    """Every ``(tp, cp, pp, dp)`` of powers of two with ``tp * cp * pp * dp == gpus``: ``tp`` divides the
    KV heads, ``pp`` is at most the layers (a stage holds ``ceil(layers / pp)``), ``dp * micro_batch``
    divides the ``global_batch`` sequences."""
    if gpus < 1 or gpus & (gpus - 1):
        raise ValueError(f"planner.layouts: gpus={gpus!r} must be a power of two")
    out = []
    for tp in _powers_of_two(min(max_tp, model.kv_heads)):
        for cp in _powers_of_two(max_cp):
            for pp in _powers_of_two(max_pp):
                dp, rest = divmod(gpus, tp * cp * pp)
                if rest or dp < 1 or pp > model.layers or global_batch % (dp * micro_batch):
                    continue
                out.append((tp, cp, pp, dp))
    return out


def sized(preset: str | Topology, gpus: int) -> Topology:
    """``preset`` with as many nodes as ``gpus`` need."""
    topology = get_topology(preset)
    nodes = -(-gpus // topology.gpus_per_node)
    return topology if nodes == topology.nodes else dataclasses.replace(topology, nodes=nodes)


def layer_activation_bytes(model: Config, seq: int, micro_batch: int, tp: int, cp: int, recompute: str) -> float:
    """Bytes one Llama layer keeps for backward on one GPU (bf16; flash attention keeps no ``s x s``
    scores): the two RMSNorm inputs, the QKV input, Q, K and V (``kv_heads / heads`` of Q each), the
    attention output (the projection's input), the MLP input, and the four SwiGLU tensors (gate, up,
    silu(gate), their product): ``2 sb (6h + 2h kv/a + 4 ffn) / (tp cp)``. Full recomputation keeps the
    layer input only: ``2 sbh / (tp cp)``."""
    if recompute not in ("selective", "full"):
        raise ValueError(f"planner: recompute={recompute!r} must be 'selective' or 'full'")
    sb, h = seq * micro_batch, model.hidden
    if recompute == "full":
        return 2 * sb * h / (tp * cp)
    return 2 * sb * (6 * h + 2 * h * model.kv_heads / model.heads + 4 * model.ffn) / (tp * cp)


def memory_per_gpu(model: Config, layout: tuple[int, int, int, int], *, seq: int, micro_batch: int = 1,
                   global_batch: int, zero: int = 1, gradients: str = "fp32 main_grad",
                   recompute: str = "selective") -> dict[str, float]:
    """Bytes by label on the pipeline stage that needs the most (module docstring), and ``stage``."""
    tp, cp, pp, dp = layout
    m = global_batch // (dp * micro_batch)                       # micro-batches per step and replica
    layers = -(-model.layers // pp)                              # the fullest stage
    embedding = model.vocab * model.hidden / tp
    per_layer = layer_activation_bytes(model, seq, micro_batch, tp, cp, recompute)
    logits = 6 * seq * micro_batch * model.vocab / (tp * cp)      # bf16 logits and their fp32 copy for the loss
    stack = layers * model.layer_parameters / tp
    stages = {"first": (stack + embedding, min(pp, m) * layers * per_layer),
              "last": (stack + embedding + model.hidden, layers * per_layer + logits)}     # + the final norm
    if pp == 1:
        stages = {"only": (stack + 2 * embedding + model.hidden, layers * per_layer + logits)}
    best: dict[str, float] | None = None
    for name, (psi, acts) in stages.items():
        row: dict[str, Any] = dict(expected_bytes(zero, round(psi), dp * cp, gradients))
        row["activations"] = acts
        row["total"] = sum(row[label] for label in LABELS)
        row["stage"] = name
        if best is None or row["total"] > best["total"]:
            best = row
    return best


def step_time(model: Config, layout: tuple[int, int, int, int], topology: Topology, *, seq: int,
              micro_batch: int = 1, global_batch: int, zero: int = 1, recompute: str = "selective",
              efficiency: float = 0.4) -> dict[str, float]:
    """The modelled step (seconds) and its parts: ``compute``, ``bubble``, ``tp_comm``, ``cp_comm``,
    ``dp_comm`` (all of it) and ``dp_exposed`` (what exceeds the compute), ``step_time``."""
    tp, cp, pp, dp = layout
    gpus = tp * cp * pp * dp
    m = global_batch // (dp * micro_batch)
    tokens = global_batch * seq
    matmul_params = model.layers * model.layer_parameters + model.vocab * model.hidden
    flops = 6 * matmul_params * tokens + 6 * model.layers * model.hidden * seq * tokens   # causal attention
    if recompute == "full":
        flops *= 4 / 3
    compute = flops / (gpus * topology.compute_flops * efficiency)
    bubble = compute * (pp - 1) / m
    grid = mesh(layout)                                              # the groups of rank 0, on the mesh
    layers = -(-model.layers // pp)
    passes = 3 if recompute == "full" else 2                         # forward (again), backward
    tp_comm = cp_comm = 0.0
    if tp > 1:
        activation = 2 * seq * micro_batch * model.hidden // cp                   # (s/cp, b, h) bf16
        one = (estimate("all_gather", activation, tp, topology, ranks=grid.group_of(0, "tp")).time
               + estimate("reduce_scatter", activation, tp, topology, ranks=grid.group_of(0, "tp")).time)
        tp_comm = layers * m * 2 * passes * one                                    # 2 sublayers
    if cp > 1:
        kv = 2 * 2 * seq * micro_batch * (model.hidden * model.kv_heads // model.heads) // max(1, tp)
        cp_comm = layers * m * passes * estimate("all_gather", kv, cp, topology, ranks=grid.group_of(0, "cp")).time
    psi = (layers * model.layer_parameters + model.vocab * model.hidden) / tp
    shard_group = grid.group_of(0, "dp", "cp")                                  # the ZeRO shards
    dp_comm = 0.0
    if dp * cp > 1:
        grad_bytes = int(4 * psi)                                                   # fp32 gradients
        dp_comm = (estimate("reduce_scatter", grad_bytes, dp * cp, topology, ranks=shard_group).time
                   + estimate("all_gather", int(2 * psi), dp * cp, topology, ranks=shard_group).time)
        if zero == 3:
            dp_comm += estimate("all_gather", int(2 * psi), dp * cp, topology, ranks=shard_group).time
    dp_exposed = max(0.0, dp_comm - compute)
    return {"compute": compute, "bubble": bubble, "tp_comm": tp_comm, "cp_comm": cp_comm, "dp_comm": dp_comm,
            "dp_exposed": dp_exposed, "step_time": compute + bubble + tp_comm + cp_comm + dp_exposed,
            "micro_batches": m}


def plan(model: Config, gpus: int, *, seq: int = 8192, global_batch: int | None = None, micro_batch: int = 1,
         zero: int = 1, gradients: str = "fp32 main_grad", recompute: str = "selective",
         topology: str | Topology = "h100-ndr-cluster", efficiency: float = 0.4, **limits: int) -> list[dict]:
    """One row per layout of :func:`layouts`: ``tp, cp, pp, dp``, bytes per GPU by label and ``total``,
    the modelled ``step_time`` and its parts, and ``tokens_per_gpu_s``. ``global_batch``: sequences
    per step (default ``gpus``); layouts whose ``dp * micro_batch`` does not divide it are left out.
    ``limits``: ``max_tp``, ``max_cp``, ``max_pp``."""
    global_batch = gpus if global_batch is None else global_batch
    topology = sized(topology, gpus)
    rows = []
    for layout in layouts(model, gpus, global_batch=global_batch, micro_batch=micro_batch, **limits):
        row: dict[str, Any] = dict(zip(DIMENSIONS, layout))
        row.update(memory_per_gpu(model, layout, seq=seq, micro_batch=micro_batch, global_batch=global_batch,
                                  zero=zero, gradients=gradients, recompute=recompute))
        row.update(step_time(model, layout, topology, seq=seq, micro_batch=micro_batch, global_batch=global_batch,
                             zero=zero, recompute=recompute, efficiency=efficiency))
        row["tokens_per_gpu_s"] = global_batch * seq / (gpus * row["step_time"])
        rows.append(row)
    return rows


def fastest_fitting(rows: list[dict], limit: float, time: str = "step_time"
                    ) -> tuple[int, int, int, int] | Layout | None:
    """The layout of the row with the shortest ``row[time]`` among ``rows`` whose memory per GPU fits
    ``limit`` bytes; ``None`` when none fits. Two kinds of rows, one rule:

    * :func:`plan`'s rows (modelled; they hold a ``total``): memory ``total``, time ``step_time``;
      the layout returned is the row's ``(tp, cp, pp, dp)`` (:func:`key`);
    * :func:`simcomm.planning.layout_choice.layout_table`'s rows (measured): memory ``peak_bytes``,
      a time per topology name (``time="NVLink node"``); the layout returned is the row's
      ``Layout(pp=, dp=, tp=)``."""
    modelled = bool(rows) and "total" in rows[0]
    memory = "total" if modelled else "peak_bytes"
    fitting = [row for row in rows if row[memory] <= limit]
    if not fitting:
        return None
    best = min(fitting, key=lambda row: row[time])
    return key(best) if modelled else Layout(pp=best["pp"], dp=best["dp"], tp=best["tp"])


def published_layouts() -> list[dict]:
    """Published training layouts and what they measured, with the :func:`plan` arguments that
    describe each run: ``source``, ``model``, ``gpus``, ``layout`` ``(tp, cp, pp, dp)``, ``plan``
    (keyword arguments), ``memory_gib`` and ``tps`` (tokens per GPU per second) where published.

    Sources: Llama 3 paper (Dubey et al. 2024, Table 4: 405B on 16,384 H100s; 8K and 128K
    sequences); torchtitan ``docs/performance.md`` (Llama 3.1 on H100s, 96 GB HBM2e; Tables 2-4:
    memory per GPU, the maximum over GPUs, and TPS/GPU with torch.compile and Float8)."""
    tt = "torchtitan"
    return [
        {"source": "Llama 3 paper, Table 4 (8K sequences)", "model": LLAMA3_405B, "gpus": 16384,
         "layout": (8, 1, 16, 128), "plan": {"seq": 8192, "global_batch": 2048, "recompute": "full"},
         "memory_gib": None, "tps": None},
        {"source": "Llama 3 paper, Table 4 (128K sequences)", "model": LLAMA3_405B, "gpus": 16384,
         "layout": (8, 16, 16, 8), "plan": {"seq": 131072, "global_batch": 128, "recompute": "full"},
         "memory_gib": None, "tps": None},
        {"source": f"{tt}, Table 3 (FSDP)", "model": LLAMA3_8B, "gpus": 128, "layout": (1, 1, 1, 128),
         "plan": {"seq": 8192, "global_batch": 256, "micro_batch": 2, "zero": 3}, "memory_gib": 67.0, "tps": 5605},
        {"source": f"{tt}, Table 4 (FSDP + TP, Float8)", "model": LLAMA3_70B, "gpus": 256, "layout": (8, 1, 1, 32),
         "plan": {"seq": 8192, "global_batch": 512, "micro_batch": 16, "zero": 3, "recompute": "full"},
         "memory_gib": 71.9, "tps": 829},
        {"source": f"{tt}, Table 2 (32K, Float8)", "model": LLAMA3_8B, "gpus": 8, "layout": (1, 1, 1, 8),
         "plan": {"seq": 32768, "global_batch": 8, "zero": 3, "recompute": "full"}, "memory_gib": 83.9, "tps": 3890},
        {"source": f"{tt}, Table 2 (CP 8, 256K, Float8)", "model": LLAMA3_8B, "gpus": 8, "layout": (1, 8, 1, 1),
         "plan": {"seq": 262144, "global_batch": 1, "zero": 3, "recompute": "full"}, "memory_gib": 84.5, "tps": 548},
    ]
