"""Plan a cluster: memory per GPU and modelled step time of every 4-D layout of a GPU budget.

For a Llama (:class:`simcomm.models.llama.Config`; the Llama 3 shapes
:data:`~simcomm.models.llama.LLAMA3_8B`, ``LLAMA3_70B``, ``LLAMA3_405B``) on
``gpus = tp * cp * pp * dp`` GPUs, ranks placed on the project's one mesh
(:class:`simcomm.parallel.mesh.Layout`, :func:`mesh`: pipeline outermost,
then data, context and tensor parallelism innermost, ``init_device_mesh``'s
row-major order and torchtitan's; a tensor group is ``tp`` consecutive GPUs,
inside one node when ``tp <= 8``), :func:`plan` returns one row per layout.
What a run does is a :class:`Recipe` (how it trains) and a :class:`GPU` (what
one GPU sustains); :func:`simcomm.planning.published.published_runs` holds the
recipes of published runs.

**Memory per GPU** (:func:`memory_per_gpu`), on the pipeline stage that needs the most:

* model states for this GPU's share of the parameters (``1/tp`` of ``ceil(layers/pp)``
  layers, plus the embedding on the first stage and the output layer on the last):
  ``states="megatron"`` (Megatron-LM, the Llama 3 paper): bf16 parameters, fp32
  ``main_grad`` gradients, fp32 master + Adam sharded over the ``dp * cp`` ranks
  (:func:`simcomm.parallel.mixed_precision.expected_bytes`, ZeRO ``zero``);
  ``states="fsdp2"`` (torchtitan): fp32 parameters, gradients and Adam's two moments,
  all sharded over ``dp * cp`` (16 bytes per parameter in all);
* ``unsharded``: what FSDP2 gathers: without pipeline parallelism the bf16 parameters of
  two layers (the one running, the one prefetched) and of the root (embedding, output),
  and one layer's fp32 gradients before their reduce-scatter; under pipeline
  parallelism FSDP2 does not reshard (torchtitan: ``reshard_after_forward=False``), so
  the whole stage's bf16 parameters, and its gradients accumulated unsharded over the
  micro-batches (in the fp32 reduce dtype, as FSDP2 accumulates without gradient sync);
* ``activations``: what each layer keeps for backward (:func:`layer_activation_bytes`,
  by ``recompute``), times the stage's layers, times the micro-batches the schedule
  keeps in flight on the first stage (:func:`in_flight`);
* ``workspace``: the transient peak of the backward: one layer's recomputed
  activations and gradient temporaries (under DTensor TP also its all-gathered inputs at
  full width), or on the last stage the loss (:func:`loss_bytes`: 12 bytes per logit,
  16 under DTensor's ``loss_parallel`` with the output layer's gathered input);
* ``overhead``: the caching allocator's fragmentation, NCCL and library workspaces,
  as a fraction of the rest (``GPU.memory_overhead``, calibrated).

**Step time** (:func:`step_time`): per op, not one flat efficiency:

* each GEMM of a layer (QKV, O, gate, up, down; forward, and the data- and
  weight-gradient GEMMs of backward) at :func:`gemm_time`: the GPU's sustained
  fraction of peak times wave quantization (tiles of 128 x 256 over 132 SMs, NVIDIA's
  *Matrix Multiplication Background User's Guide*), or the HBM time of its operands
  when that is longer; Float8 GEMMs at twice the bf16 peak plus the casts;
* attention (flash, causal: half the ``s x s`` work) at the kernel's published
  efficiency (:data:`ATTENTION`), forward and backward (2.5 x the forward's flops);
* the elementwise ops (norms, RoPE, SwiGLU, residuals; fewer bytes with torch.compile)
  at HBM bandwidth; the optimizer step at HBM bandwidth;
* recomputation: full (the layer's forward again) or op-level selective (the GEMMs
  and elementwise ops whose outputs are not saved);
* the pipeline bubble of the ``schedule``: 1F1B ``(pp - 1)`` micro-batch times,
  interleaved ``(pp - 1) / v``, zero bubble (ZB-H1) ``(pp - 1) / 3``;
* tensor parallel collectives (sequence parallel: all-gather + reduce-scatter per
  sublayer) exposed, or with async TP only what exceeds the GEMMs they overlap;
  context parallel K/V all-gathers exposed (the Llama 3 paper's), or ring attention
  step by step (:func:`ring_attention_exposed`: the exchange that outlasts a ring step's
  attention, and the fp32 merges); data parallel reduce-scatter / all-gather exposed beyond
  the compute they overlap (the whole step without pipeline parallelism, the last
  micro-batch's backward and the first one's forward with it); each collective from
  :func:`simcomm.model.cost.estimate` on the group's real GPUs.

Throughput is reported as tokens per GPU per second and as TFLOPs per GPU in the
``6 N + 12 L h s`` convention of PaLM, torchtitan and the Llama 3 paper (``N`` the
parameters less the embedding; attention counted as if not causal), with MFU
beside it, and the causal count (``6 N + 6 L h s``) that the GPU actually runs.

It is a model, not a measurement: no values are computed, collectives are
modelled (alpha-beta, :mod:`simcomm.model.cost`), and the GPU's sustained fraction
of peak and memory overhead are calibrated on named published rows
(:func:`simcomm.planning.published.calibrate`; the other rows only validate). The shape-only simulator
(``World(n, tensors="shape")``) checks per-rank accounting on traced programs.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..model.cost import estimate
from ..model.topology import Topology, get_topology
from ..models.llama import LLAMA3_8B, LLAMA3_70B, LLAMA3_405B, Config
from ..parallel.mesh import Layout
from ..parallel.mixed_precision import expected_bytes

__all__ = ["DIMENSIONS", "LABELS", "RECOMPUTE", "SCHEDULES", "STATES", "ATTENTION", "GPU", "H100_SXM",
           "H100_HBM2E", "H100_MEMORY", "Recipe", "layouts", "mesh", "plan", "memory_per_gpu", "step_time",
           "layer_activation_bytes", "loss_bytes", "ring_attention_exposed", "stage_parameters", "in_flight", "KERNELS", "evaluate", "stage_layers", "gemm_time", "flops_per_token", "fastest_fitting", "key",
           "sized", "GiB", "published_layouts", "LLAMA3_8B", "LLAMA3_70B", "LLAMA3_405B"]

GiB = 2 ** 30
#: the order of a layout tuple's sizes (innermost first, as the Llama 3 paper lists them); the ranks'
#: order is the mesh's (:func:`mesh`)
DIMENSIONS = ("tp", "cp", "pp", "dp")
#: the memory labels of a row, bottom to top of a stacked bar; they sum to ``total``
LABELS = ("parameters", "gradients", "optimizer_state", "unsharded", "activations", "workspace", "overhead")
#: activation checkpointing: none, torchtitan's op-level selective, full (module docstring)
RECOMPUTE = ("none", "selective", "full")
#: pipeline schedules
SCHEDULES = ("1f1b", "interleaved", "zero_bubble")
#: how model states are held
STATES = ("megatron", "fsdp2")
#: which tensors a layer saves without checkpointing: torchtitan's eager Llama, or fused kernels
#: (Transformer Engine's LayerNorm-Linear and SwiGLU, as Megatron-LM runs them)
KERNELS = ("eager", "fused")
#: memory an H100 80GB offers: 81,559 MiB, as ``nvidia-smi`` reports it (79.6 GiB, not 80)
H100_MEMORY = 81559 * 2 ** 20

#: flash attention's sustained fraction of the H100's dense bf16 peak, (forward, backward), causal,
#: head dim 128, long sequences: FlashAttention-3 (Shah et al. 2024, arXiv 2407.08608, section 1 and
#: Figures 5-7): FlashAttention-2 reaches about 35 % of the H100's peak in the forward pass
#: ("fa2", the flash kernel of ``torch.nn.functional.scaled_dot_product_attention``), FlashAttention-3
#: 600-660 TFLOPs forward and about 450-550 backward at 8K-16K ("fa3"; 0.62 and 0.48 of 989)
ATTENTION = {"fa2": (0.35, 0.30), "fa3": (0.62, 0.48)}


@dataclasses.dataclass(frozen=True)
class GPU:
    """What one GPU sustains. ``peak``: dense bf16 flop/s (datasheet; Float8 runs at twice it);
    ``hbm``: memory bandwidth, bytes/s; ``gemm``: the fraction of ``peak`` a large bf16 GEMM sustains
    in a training step (clocks under the power limit included), and ``memory_overhead``: the
    allocator's and libraries' share on top of the counted bytes: both calibrated on one published
    row each (:func:`simcomm.planning.published.calibrate`); ``capacity``: usable bytes."""

    name: str
    peak: float
    hbm: float
    gemm: float
    memory_overhead: float
    capacity: float
    sms: int = 132


#: an H100 SXM 80GB at 700 W (Meta's Llama 3 cluster): 989 TFLOPs dense bf16, 3.35 TB/s HBM3
#: (NVIDIA H100 datasheet); ``gemm`` calibrated on the Llama 3 paper's 405B 8K row on 16,384 GPUs
H100_SXM = GPU("H100 SXM 80GB", peak=989e12, hbm=3.35e12, gemm=0.650, memory_overhead=0.128,
               capacity=H100_MEMORY)
#: torchtitan's H100 96GB HBM2e at 500 W (its docs/performance.md: 2.4 TB/s; peak "between SXM and
#: NVL", so the SXM datasheet peak with the calibrated ``gemm``); ``gemm`` and ``memory_overhead``
#: calibrated on torchtitan's Table 1 FSDP row (Llama 3.1 8B, 8 GPUs)
H100_HBM2E = GPU("H100 96GB HBM2e (500 W)", peak=989e12, hbm=2.4e12, gemm=0.397, memory_overhead=0.128,
                 capacity=96e9)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How a run trains (what :func:`plan` needs beyond the model and the layout).

    ``seq``: tokens per sequence; ``global_batch``: sequences per step; ``micro_batch``:
    sequences per micro-batch and data-parallel rank; ``recompute``: one of :data:`RECOMPUTE`;
    ``schedule``: one of :data:`SCHEDULES`, ``virtual_stages`` (interleaved: chunks per rank;
    0 picks two layers per chunk); ``states``: one of :data:`STATES`, ``zero`` and ``gradients``
    (``"megatron"`` only); ``float8``: the linear layers' GEMMs in Float8; ``async_tp``: TP
    collectives overlapped with the GEMMs; ``cp_ring``: context parallel K/V exchange overlapped
    with attention (ring attention; else an exposed all-gather, as the Llama 3 paper's);
    ``compiled``: torch.compile fuses the elementwise ops; ``attention``: a key of
    :data:`ATTENTION`; ``kernels``: which tensors a layer saves without checkpointing
    (:data:`KERNELS`, :func:`layer_activation_bytes`); ``balanced``: the first and last pipeline
    stages hold one layer fewer (the Llama 3 paper's balanced pipeline); ``repeat_kv``: the K/V heads
    are repeated to all heads before attention (torchtitan's Llama; ring attention then sends them at full width);
    ``dtensor_tp``: tensor parallelism through DTensor as torchtitan applies it: the loss under
    ``torch.distributed.tensor.parallel.loss_parallel`` (:func:`loss_bytes`), each layer's all-gathered
    attention and FFN inputs saved at full width (in the recompute working set), and with Float8 those
    inputs cast once per sublayer before their all-gather (torchtitan's ``PrepareFloat8ModuleInput``:
    the casts cost ``1/tp`` of the gathered input);
    ``attention_scale``: a factor on the attention kernel's efficiency (1: the published figure; what-if studies);
    ``topology``: the network (a preset name)."""

    seq: int = 8192
    global_batch: int | None = None
    micro_batch: int = 1
    recompute: str = "selective"
    schedule: str = "1f1b"
    virtual_stages: int = 0
    states: str = "megatron"
    zero: int = 1
    gradients: str = "fp32 main_grad"
    float8: bool = False
    async_tp: bool = False
    cp_ring: bool = False
    compiled: bool = False
    attention: str = "fa3"
    kernels: str = "eager"
    balanced: bool = False
    attention_scale: float = 1.0
    repeat_kv: bool = False
    dtensor_tp: bool = False
    topology: str = "h100-ndr-cluster"

    def __post_init__(self) -> None:
        for name, allowed in (("recompute", RECOMPUTE), ("schedule", SCHEDULES), ("states", STATES),
                              ("kernels", KERNELS),
                              ("attention", tuple(ATTENTION))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"planner.Recipe: {name}={getattr(self, name)!r} must be one of {list(allowed)}")
        for name in ("seq", "micro_batch"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"planner.Recipe: {name}={getattr(self, name)!r} must be a positive int")


def _recipe(recipe: Recipe | None, kwargs: dict) -> Recipe:
    if recipe is None:
        return Recipe(**kwargs)
    return dataclasses.replace(recipe, **kwargs) if kwargs else recipe


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


def layer_activation_bytes(model: Config, seq: int, micro_batch: int, tp: int, cp: int, recompute: str,
                           kernels: str = "eager") -> float:
    """Bytes one Llama layer keeps for backward on one GPU, bf16, tensor + sequence parallel over ``tp``,
    the sequence split over ``cp`` (``T = seq * micro_batch / cp`` tokens; ``kv = h kv_heads / heads``):

    * ``"none"``: every saved tensor: the two norms' inputs and outputs, Q, K, V, the attention output
      and its contiguous copy (the O projection's input), the SwiGLU's gate, up, silu(gate) and their
      product: ``2 T (7h + 2kv + 4 ffn) / tp`` (flash attention keeps no ``s x s`` scores);
      with ``kernels="fused"`` (Transformer Engine: one normalized input per fused norm-GEMM,
      the fc1 output and the SwiGLU output): ``2 T (6h + 2kv + 3 ffn) / tp``;
    * ``"selective"``: torchtitan's op-level selective checkpointing (``_save_list``: the outputs of
      every other ``mm``, of flash attention and of TP reduce-scatters are saved, the rest recomputed):
      the layer's input, Q (1st mm), V (3rd), the attention output, the gate (5th) and the down
      projection's output (7th): ``2 T (4h + kv + ffn) / tp``;
    * ``"full"``: the layer's input only: ``2 T h / tp``."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"planner: recompute={recompute!r} must be one of {list(RECOMPUTE)}")
    tokens, h, f = seq * micro_batch / cp, model.hidden, model.ffn
    kv = h * model.kv_heads / model.heads
    if kernels not in KERNELS:
        raise ValueError(f"planner: kernels={kernels!r} must be one of {list(KERNELS)}")
    none = 7 * h + 2 * kv + 4 * f if kernels == "eager" else 6 * h + 2 * kv + 3 * f
    per_token = {"none": none, "selective": 4 * h + kv + f, "full": h}[recompute]
    return 2 * tokens * per_token / tp


def _working_set(model: Config, tokens: float, tp: int, recompute: str, kernels: str = "eager") -> float:
    """The transient bytes of one layer's backward: the layer's recomputed activations (unless none
    are recomputed) and two ``ffn``-wide gradient temporaries."""
    recomputed = 0.0 if recompute == "none" else layer_activation_bytes(model, tokens, 1, tp, 1, "none", kernels)
    return recomputed + 2 * tokens * 2 * model.ffn / tp


def loss_bytes(model: Config, tokens: float, tp: int, dtensor_tp: bool = False) -> float:
    """The loss's transient peak on the last stage, one micro-batch of ``tokens``, logits sharded over
    ``tp`` by vocabulary: ``torch.nn.functional.cross_entropy`` on fp32 logits holds, at the backward's
    peak, the saved fp32 log-probabilities, the NLL's gradient and log-softmax's gradient: 12 bytes per
    logit. Under DTensor tensor parallelism (``dtensor_tp``) with ``loss_parallel`` (torchtitan's default), the NLL and
    log-softmax backward are one decomposed expression, ``(grad_input + exp(x)) * grad_output``: the
    saved log-probabilities, the zeroed ``grad_input``, their sum and the product are held at once,
    16 bytes per logit; and the output layer keeps its all-gathered input (the final norm's output,
    ``tokens x h`` bf16, full width) for its weight gradient."""
    logits = tokens * model.vocab / tp
    if tp > 1 and dtensor_tp:
        return 16 * logits + 2 * tokens * model.hidden
    return 12 * logits


def in_flight(pp: int, micro_batches: int, schedule: str = "1f1b", virtual_stages: int = 1,
              stage: int = 0) -> float:
    """How many micro-batches' worth of a stage's activations ``stage`` holds at its peak: 1F1B and
    ZB-H1 ``min(pp - stage, m)``; interleaved 1F1B (``v`` chunks per rank, Megatron's warm-up of
    ``(v - 1) pp + 2 (pp - 1 - stage)`` chunk forwards plus the one running) that many chunks, each
    ``1/v`` of the stage, at most ``m v``; one when ``pp == 1``."""
    if schedule not in SCHEDULES:
        raise ValueError(f"planner.in_flight: schedule={schedule!r} must be one of {list(SCHEDULES)}")
    if pp == 1:
        return 1.0
    if schedule != "interleaved" or virtual_stages <= 1:
        return float(min(pp - stage, micro_batches))
    v = virtual_stages
    return min(micro_batches * v, (v - 1) * pp + 2 * (pp - 1 - stage) + 1) / v


def _virtual(recipe: Recipe, layers: int) -> int:
    if recipe.schedule != "interleaved":
        return 1
    return recipe.virtual_stages or max(1, layers // 2)


def stage_layers(layers: int, pp: int, balanced: bool = False) -> tuple[int, int, int]:
    """Layers on the (first, fullest middle, last) stage: ``ceil(layers / pp)`` each, or ``balanced``
    (the Llama 3 paper: the first and last stage one layer fewer, the rest spread over the middle)."""
    each = -(-layers // pp)
    if not balanced or pp < 3 or each < 2:
        return each, each, each
    middle = -(-(layers - 2 * (each - 1)) // (pp - 2))
    return each - 1, middle, each - 1


def _stages(model: Config, pp: int, balanced: bool = False) -> dict[str, tuple[int, float, int, bool]]:
    """name -> (layers, parameters on one GPU before tp, stage index, has the output layer) of the
    stages that can need the most."""
    vh = model.vocab * model.hidden
    lp = model.layer_parameters
    if pp == 1:
        return {"only": (model.layers, model.layers * lp + 2 * vh + model.hidden, 0, True)}
    first, middle, last = stage_layers(model.layers, pp, balanced)
    stages = {"first": (first, first * lp + vh, 0, False), "last": (last, last * lp + vh + model.hidden, pp - 1, True)}
    if middle != first and pp > 2:
        stages["second"] = (middle, middle * lp, 1, False)
    return stages


def stage_parameters(model: Config, layout: tuple[int, int, int, int]) -> float:
    """Parameters one GPU holds on the pipeline stage that holds the most: ``1/tp`` of its layers, plus the
    embedding on the first stage and the output layer and final norm on the last; with ``pp == 1``
    one stage holds all of them (lesson 15's exercise 4)."""
    tp, _cp, pp, _dp = layout
    return max(psi for _layers, psi, _stage, _last in _stages(model, pp).values()) / tp


def memory_per_gpu(model: Config, layout: tuple[int, int, int, int], recipe: Recipe | None = None, *,
                   gpu: GPU = H100_SXM, **kwargs: Any) -> dict[str, Any]:
    """Bytes by label (:data:`LABELS`), ``total`` and ``stage`` on the pipeline stage that needs the
    most (module docstring). ``kwargs``: :class:`Recipe` fields (``seq``, ``global_batch``, ...)."""
    recipe = _recipe(recipe, kwargs)
    tp, cp, pp, dp = layout
    global_batch = recipe.global_batch or tp * cp * pp * dp
    m = global_batch // (dp * recipe.micro_batch)
    shards = dp * cp
    tokens = recipe.seq * recipe.micro_batch / cp
    per_layer = layer_activation_bytes(model, recipe.seq, recipe.micro_batch, tp, cp, recipe.recompute,
                                       recipe.kernels)
    layer_params = model.layer_parameters / tp
    root = 2 * model.vocab * model.hidden / tp
    best: dict[str, Any] | None = None
    for name, (layers, psi_all, stage, last) in _stages(model, pp, recipe.balanced).items():
        psi = psi_all / tp
        if recipe.states == "megatron":
            row: dict[str, Any] = dict(expected_bytes(recipe.zero, round(psi), shards, recipe.gradients))
            row["unsharded"] = 0.0
        else:
            row = {"parameters": 4 * psi / shards, "gradients": 4 * psi / shards,
                   "optimizer_state": 8 * psi / shards}
            if shards == 1:
                row["unsharded"] = 0.0
            elif pp == 1:      # resharded after forward: two layers, the root, one layer's fp32 gradients
                row["unsharded"] = 2 * (2 * layer_params + root) + 4 * layer_params
            else:              # no reshard under PP: the stage's bf16 parameters, and its gradients
                row["unsharded"] = 2 * psi + 4 * psi      # accumulated unsharded in the fp32 reduce dtype
        held = in_flight(pp, m, recipe.schedule, _virtual(recipe, layers), stage)
        row["activations"] = held * layers * per_layer
        working = _working_set(model, tokens, tp, recipe.recompute, recipe.kernels)
        if tp > 1 and recipe.dtensor_tp:           # DTensor TP saves each gathered matmul input at full width
            working += 2 * tokens * model.hidden * (1 if recipe.float8 else 2)
        if last:
            working = max(working, loss_bytes(model, tokens, tp, recipe.dtensor_tp))
        row["workspace"] = working
        counted = sum(row[label] for label in LABELS[:-1])
        row["overhead"] = gpu.memory_overhead * counted
        row["total"] = counted + row["overhead"]
        row["stage"] = name
        if best is None or row["total"] > best["total"]:
            best = row
    return best


def gemm_time(m: float, n: float, k: float, gpu: GPU = H100_SXM, float8: bool = False,
              input_cast: float = 1.0) -> float:
    """Seconds of one ``(m x k) @ (k x n)`` GEMM: ``2 m n k`` flops at ``gpu.peak x gpu.gemm`` (twice
    the peak in Float8) times the wave efficiency (output tiles of 128 x 256, one per SM at a time:
    ``tiles / (waves x SMs)``), or the HBM time of reading both operands and writing the bf16 result
    when that is longer; Float8 adds the casts (read bf16, take the amax, write fp8: 5 bytes per
    operand element; ``input_cast``: the fraction of the ``m x k`` operand this GEMM casts itself, less
    than 1 when the cast happened once before a tensor-parallel all-gather or is shared)."""
    tiles = math.ceil(m / 128) * math.ceil(n / 256)
    waves = math.ceil(tiles / gpu.sms)
    wave_efficiency = tiles / (waves * gpu.sms)
    peak = gpu.peak * (2 if float8 else 1)
    itemsize = 1 if float8 else 2
    compute = 2 * m * n * k / (peak * gpu.gemm * wave_efficiency)
    memory = (itemsize * (m * k + k * n) + 2 * m * n) / gpu.hbm
    casts = 5 * (input_cast * m * k + k * n) / gpu.hbm if float8 else 0.0
    return max(compute, memory) + casts


def _layer_times(model: Config, recipe: Recipe, tp: int, cp: int, gpu: GPU) -> dict[str, float]:
    """One layer, one micro-batch, one GPU: seconds of its ``gemm_forward``, ``gemm_backward``,
    ``attention_forward``, ``attention_backward``, ``elementwise`` (forward + backward) and
    ``recompute``."""
    t = recipe.seq * recipe.micro_batch / cp
    h, f = model.hidden, model.ffn
    kv = h * model.kv_heads / model.heads
    shapes = {"qkv": (t, (h + 2 * kv) / tp, h), "wo": (t, h, h / tp), "w1": (t, f / tp, h),
              "w3": (t, f / tp, h), "w2": (t, h, f / tp)}
    f8 = recipe.float8
    cast = {name: 1.0 for name in shapes}
    if tp > 1 and recipe.dtensor_tp:      # cast once per sublayer before the all-gather: 1/tp of it
        cast.update(qkv=1 / tp, w1=1 / tp, w3=0.0)
    forward = {name: gemm_time(*mnk, gpu, f8, cast[name]) for name, mnk in shapes.items()}
    backward = sum(gemm_time(m_, k_, n_, gpu, f8) + gemm_time(k_, n_, m_, gpu, f8)
                   for m_, n_, k_ in shapes.values())
    att_fwd, att_bwd = (value * recipe.attention_scale for value in ATTENTION[recipe.attention])
    attention_flops = 2 * t * recipe.seq * h / tp            # 4 T (s/2) h / tp: causal, flash
    attention_forward = attention_flops / (gpu.peak * att_fwd)
    attention_backward = 2.5 * attention_flops / (gpu.peak * att_bwd)
    per_token = (8 * h + 3 * f) if recipe.compiled else (20 * h + 5 * f)   # bf16 elements moved
    elementwise_forward = 2 * t * per_token / tp / gpu.hbm
    if recipe.recompute == "full":
        recompute = sum(forward.values()) + attention_forward + elementwise_forward
    elif recipe.recompute == "selective":     # the even-numbered mms (K, O, up) and the elementwise ops
        k_shape = (t, kv / tp, h)
        recompute = gemm_time(*k_shape, gpu, f8) + forward["wo"] + forward["w3"] + elementwise_forward
    else:
        recompute = 0.0
    return {"gemm_forward": sum(forward.values()), "gemm_backward": backward,
            "attention_forward": attention_forward, "attention_backward": attention_backward,
            "elementwise": 3 * elementwise_forward, "recompute": recompute}


def flops_per_token(model: Config, seq: int, causal: bool = False) -> float:
    """Training flops per token: ``6 N + 12 L h s`` (PaLM's convention, torchtitan's and the Llama 3
    paper's MFU; ``N`` the parameters less the input embedding) or, ``causal``, ``6 N + 6 L h s``
    (the attention a causal mask leaves)."""
    n = model.parameters - model.vocab * model.hidden
    return 6 * n + (6 if causal else 12) * model.layers * model.hidden * seq


def ring_attention_exposed(model: Config, recipe: Recipe, tp: int, cp: int, one: dict[str, float],
                           topology: Topology, ranks: list[int], gpu: GPU = H100_SXM) -> dict[str, float]:
    """Seconds ring attention adds to one layer and one micro-batch beyond its attention kernels, on one
    GPU (``one``: :func:`_layer_times`), as ``torch.distributed.tensor.experimental.context_parallel``
    runs it (torchtitan's CP; its defaults: K/V rotated by one all-gather, head-tail load balancing,
    partial results merged and gradients accumulated in fp32):

    * **load balancing**: each GPU holds two of ``2 cp`` sequence chunks (the i-th and the
      ``(2 cp - 1 - i)``-th), so each of the ``cp`` ring steps is one kernel over an equal share of the
      causal work: step 0 the local block (causal), every later step half a block (all local queries
      against the first half of the arriving K/V, or the second half of the queries against all of it);
      one step's kernel is ``1/cp`` of the layer's attention;
    * **forward** (run twice under full recomputation): the K/V of every other GPU arrive by one
      all-gather issued before step 0 and awaited before step 1: exposed ``max(0, all-gather - step)``;
    * **backward**: the same all-gather for K/V, and each step's dK/dV (fp32) sent point to point to the
      next GPU, awaited after the following step: exposed ``max(0, send - step)`` per step, and the last
      send entirely;
    * **merge and accumulation** at HBM bandwidth: each forward step after the first merges its partial
      output into the fp32 running output (cast 6, difference 12, scaled 8, update 12: 38 bytes per
      output element) and concatenates K/V for sending (4 bytes per element); each backward step adds
      dQ, dK, dV into fp32 accumulators (10 bytes per element) and concatenates dK/dV in fp32 (8) and K/V
      (4).

    K/V travel at the width attention sees them: ``kv = h kv_heads / heads`` per token, or ``h`` when
    ``recipe.repeat_kv`` (torchtitan's Llama repeats the K/V heads before calling SDPA). Returns
    ``exposed`` (the sum) and its parts ``forward_comm``, ``backward_comm``, ``merge``."""
    t = recipe.seq * recipe.micro_batch / cp
    h = model.hidden
    width = h if recipe.repeat_kv else h * model.kv_heads / model.heads
    q_elems = t * h / tp
    kv_elems = 2 * t * width / tp                                   # K and V of the local chunks
    gather = estimate("all_gather", int(2 * kv_elems * cp), cp, topology, ranks=ranks).time
    send = estimate("send_recv", int(4 * kv_elems), 2, topology, ranks=ranks[:2]).time
    step_forward = one["attention_forward"] / cp
    step_backward = one["attention_backward"] / cp
    forwards = 2 if recipe.recompute == "full" else 1
    forward_comm = forwards * max(0.0, gather - step_forward)
    backward_comm = (max(0.0, gather - step_backward) + (cp - 1) * max(0.0, send - step_backward) + send)
    merge_forward = (cp - 1) * 38 * q_elems * 0.75 + cp * 4 * kv_elems + 6 * q_elems   # partial steps: 3/4 on average
    merge_backward = cp * (10 * q_elems + 10 * kv_elems + 8 * kv_elems + 4 * kv_elems)
    merge = (forwards * merge_forward + merge_backward) / gpu.hbm
    return {"exposed": forward_comm + backward_comm + merge, "forward_comm": forward_comm,
            "backward_comm": backward_comm, "merge": merge}


def step_time(model: Config, layout: tuple[int, int, int, int], topology: Topology | str | None = None,
              recipe: Recipe | None = None, *, gpu: GPU = H100_SXM, **kwargs: Any) -> dict[str, float]:
    """The modelled step (seconds) and its parts (module docstring): ``compute`` (every micro-batch on
    the slowest stage), ``bubble``, ``tp_comm`` / ``cp_comm`` (exposed), ``pp_comm``, ``dp_comm`` (all)
    and ``dp_exposed``, ``optimizer``, ``step_time``, ``micro_batches``, ``virtual_stages``."""
    recipe = _recipe(recipe, kwargs)
    tp, cp, pp, dp = layout
    gpus = tp * cp * pp * dp
    topology = sized(topology or recipe.topology, gpus)
    global_batch = recipe.global_batch or gpus
    m = global_batch // (dp * recipe.micro_batch)
    grid = mesh(layout)
    t = recipe.seq * recipe.micro_batch / cp
    h = model.hidden
    kv = h * model.kv_heads / model.heads
    first, middle, last = stage_layers(model.layers, pp, recipe.balanced)
    layers = max(first, middle, last)
    v = _virtual(recipe, layers)
    one = _layer_times(model, recipe, tp, cp, gpu)
    layer = sum(one.values())
    output = (gemm_time(t, model.vocab / tp, h, gpu) + gemm_time(t, h, model.vocab / tp, gpu)
              + gemm_time(h, model.vocab / tp, t, gpu)
              + t * model.vocab / tp * 4 * (3 if recipe.compiled else 6) / gpu.hbm)   # the loss, fp32
    stage = max(middle * layer, last * layer + output)               # one micro-batch, the slowest stage
    tp_layer = cp_layer = 0.0
    if tp > 1:
        nbytes = int(2 * t * h)                                      # (T, h) bf16, gathered / scattered
        ranks = grid.group_of(0, "tp")
        pair = (estimate("all_gather", nbytes, tp, topology, ranks=ranks).time
                + estimate("reduce_scatter", nbytes, tp, topology, ranks=ranks).time)
        passes = {"none": 4, "selective": 5, "full": 6}[recipe.recompute]   # sublayer AG + RS each pass
        total = passes * pair
        gemms = one["gemm_forward"] + one["gemm_backward"]
        tp_layer = max(0.0, total - gemms) if recipe.async_tp else total
    if cp > 1:
        ranks = grid.group_of(0, "cp")
        if recipe.cp_ring:
            cp_layer = ring_attention_exposed(model, recipe, tp, cp, one, topology, ranks, gpu)["exposed"]
        else:
            nbytes = int(2 * 2 * t * kv / tp * cp)                   # K and V of the whole sequence
            gather = estimate("all_gather", nbytes, cp, topology, ranks=ranks).time
            scatter = estimate("reduce_scatter", nbytes, cp, topology, ranks=ranks).time
            cp_layer = gather * (3 if recipe.recompute == "full" else 2) + scatter
    per_micro_batch = stage + layers * (tp_layer + cp_layer)
    compute = m * stage
    if pp == 1:
        bubble = 0.0
    else:
        bubble = (pp - 1) * per_micro_batch / {"1f1b": 1, "interleaved": v, "zero_bubble": 3}[recipe.schedule]
    pp_comm = 0.0
    if pp > 1:
        p2p = estimate("send_recv", int(2 * t * h / tp), 2, topology,
                       ranks=[0, grid.group_of(0, "pp")[1]]).time
        pp_comm = 2 * (pp - 1) * v * p2p                              # the fill and the drain
    psi = max(psi_all for _l, psi_all, _s, _o in _stages(model, pp, recipe.balanced).values()) / tp
    shards = dp * cp
    shard_group = grid.group_of(0, "dp", "cp")
    dp_comm = 0.0
    if shards > 1:
        gather = estimate("all_gather", int(2 * psi), shards, topology, ranks=shard_group).time
        scatter = estimate("reduce_scatter", int(4 * psi), shards, topology, ranks=shard_group).time
        if recipe.states == "megatron":
            dp_comm = scatter + gather * (2 if recipe.zero == 3 else 1)
        elif pp == 1:
            dp_comm = m * (2 * gather + scatter)
        else:
            dp_comm = gather + scatter
    if recipe.states == "fsdp2" and pp == 1:
        window = compute                         # every layer's collectives overlap the other layers
    else:
        window = stage / v                       # the last micro-batch's backward, the first one's forward
    dp_exposed = max(0.0, dp_comm - window)
    optimizer = psi / shards * (28 if recipe.states == "fsdp2" else 30) / gpu.hbm
    step = compute + bubble + m * layers * (tp_layer + cp_layer) + pp_comm + dp_exposed + optimizer
    return {"compute": compute, "bubble": bubble, "tp_comm": m * layers * tp_layer,
            "cp_comm": m * layers * cp_layer, "pp_comm": pp_comm, "dp_comm": dp_comm, "dp_exposed": dp_exposed,
            "optimizer": optimizer, "step_time": step, "micro_batches": m, "virtual_stages": v}


def plan(model: Config, gpus: int, recipe: Recipe | None = None, *, gpu: GPU = H100_SXM,
         max_tp: int = 8, max_cp: int = 16, max_pp: int = 16, **kwargs: Any) -> list[dict]:
    """One row per layout of :func:`layouts`: ``tp, cp, pp, dp``, bytes per GPU by label and ``total``,
    the modelled ``step_time`` and its parts, ``tokens_per_gpu_s``, ``tflops`` per GPU (``6N + 12Lhs``),
    ``mfu`` and ``tflops_causal``. ``recipe`` (or its fields as ``kwargs``): how the run trains;
    ``global_batch`` (sequences per step) defaults to ``gpus``; layouts whose ``dp * micro_batch``
    does not divide it are left out."""
    recipe = _recipe(recipe, kwargs)
    if recipe.global_batch is None:
        recipe = dataclasses.replace(recipe, global_batch=gpus)
    rows = []
    for layout in layouts(model, gpus, global_batch=recipe.global_batch, micro_batch=recipe.micro_batch,
                          max_tp=max_tp, max_cp=max_cp, max_pp=max_pp):
        rows.append(evaluate(model, layout, recipe, gpu=gpu))
    return rows


def evaluate(model: Config, layout: tuple[int, int, int, int], recipe: Recipe | None = None, *,
             gpu: GPU = H100_SXM, **kwargs: Any) -> dict[str, Any]:
    """The :func:`plan` row of one ``layout`` (a ``(tp, cp, pp, dp)`` tuple)."""
    recipe = _recipe(recipe, kwargs)
    gpus = math.prod(layout)
    if recipe.global_batch is None:
        recipe = dataclasses.replace(recipe, global_batch=gpus)
    row: dict[str, Any] = dict(zip(DIMENSIONS, layout))
    row.update(memory_per_gpu(model, layout, recipe, gpu=gpu))
    row.update(step_time(model, layout, None, recipe, gpu=gpu))
    row["tokens_per_gpu_s"] = recipe.global_batch * recipe.seq / (gpus * row["step_time"])
    row["tflops"] = row["tokens_per_gpu_s"] * flops_per_token(model, recipe.seq) / 1e12
    row["tflops_causal"] = row["tokens_per_gpu_s"] * flops_per_token(model, recipe.seq, causal=True) / 1e12
    row["mfu"] = row["tflops"] * 1e12 / gpu.peak
    row["fits"] = row["total"] <= gpu.capacity
    return row


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
    """The published runs (:func:`simcomm.planning.published.published_runs`) as ``source``, ``model``,
    ``gpus``, ``layout`` ``(tp, cp, pp, dp)``, ``recipe``, ``gpu``, ``memory_gib``, ``tps``,
    ``tflops`` and ``role`` (``"calibrate"`` or ``"validate"``)."""
    from .published import published_runs
    return published_runs()
