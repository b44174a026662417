"""Figures and widgets that show where every element and every gradient of a collective goes.

Every figure function returns a ``plotly.graph_objects.Figure`` and prints
nothing. Provenance tensors (:mod:`simcomm.viz.provenance`) encode each
element's source rank and position in its value, so figures colour each
element by the rank it came from.

=========================  =====================================================
``collective_figure``      one op on every rank: input, output, incoming grad, input grad
``rank_grid``              one heatmap panel per rank's tensor
``allreduce_figure``       ring or binomial-tree all-reduce step by step (animation frames);
                           ``ring_allreduce_figure`` / ``tree_allreduce_figure`` name one each
``timeline_figure``        one row per rank, a bar per traced call
``comm_matrix_figure``     bytes from rank i to rank j, per op on a selector
``explore``                ipywidgets panel that redraws ``collective_figure``
``tp_mlp_shards_figure``   which rows of w1 and columns of w2 each rank holds (lesson 04)
``busbw_figure``           bus bandwidth per message size: cost model curves and measured rows
``pipeline_figure``        stage x time chart of a pipeline schedule from its trace
``bucket_overlap_figure``  exposed vs hidden communication per DDP bucket size; ``bucket_slider``
=========================  =====================================================

Importing this package changes nothing outside it. A lesson's first cell asks for
:mod:`simcomm.viz.render`'s ``"simcomm"`` renderer with ``viz.use_export_renderer()``
(it becomes plotly's default, so figures also survive an HTML export).
"""
from .algorithms import allreduce_figure, allreduce_steps, ring_allreduce_figure, tree_allreduce_figure
from .buckets import bucket_overlap_figure, bucket_slider
from .busbw import busbw_figure
from .collective import OPS, CollectiveRun, collective_figure, collective_run_figure, run_collective
from .explore import Explorer, explore
from .grids import as_grid, grid_layout, rank_grid
from .matrix import comm_matrix_figure
from .memory import memory_figure
from .pipeline import pipeline_figure
from .provenance import decode, describe, provenance_base, provenance_tensor, provenance_tensors
from .render import use_export_renderer
from .sharding import tp_mlp_shards_figure
from .timeline import human_bytes, timeline_figure

__all__ = [
    "OPS", "CollectiveRun", "collective_figure", "collective_run_figure", "run_collective",
    "as_grid", "grid_layout", "rank_grid", "allreduce_steps", "allreduce_figure", "ring_allreduce_figure",
    "tree_allreduce_figure", "Explorer", "explore",
    "comm_matrix_figure", "timeline_figure", "human_bytes", "busbw_figure", "memory_figure", "pipeline_figure",
    "bucket_overlap_figure", "bucket_slider",
    "decode", "describe", "provenance_base", "provenance_tensor", "provenance_tensors",
    "use_export_renderer", "tp_mlp_shards_figure",
]
