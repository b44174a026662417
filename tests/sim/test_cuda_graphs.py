"""CUDA graphs on virtual GPUs: a named error (a virtual GPU runs the CPU's kernels, which
nothing captures), where a CPU-only build of torch says "Tried to instantiate dummy base class"."""
from __future__ import annotations

import pytest
import torch

from simcomm import World


def test_each_cuda_graph_entry_point_raises_a_named_error_on_virtual_gpus():
    def program(comm):
        torch.cuda.set_device(comm.rank)
        errors = {}
        for name, call in [("CUDAGraph", lambda: torch.cuda.CUDAGraph()),
                           ("graph", lambda: torch.cuda.graph(None)),
                           ("graph_pool_handle", lambda: torch.cuda.graph_pool_handle()),
                           ("make_graphed_callables", lambda: torch.cuda.make_graphed_callables(len, ()))]:
            try:
                call()
            except NotImplementedError as error:
                errors[name] = str(error)
        return errors, isinstance(object(), torch.cuda.CUDAGraph)

    results = World(2, map_cuda=True).run(program)
    for rank, (errors, is_graph) in enumerate(results):
        assert sorted(errors) == ["CUDAGraph", "graph", "graph_pool_handle", "make_graphed_callables"]
        for name, message in errors.items():
            assert message.startswith(f"torch.cuda.{name}: CUDA graphs are not available")
            assert f"virtual GPU {rank}" in message and "turn the script's CUDA graphs off" in message
        assert is_graph is False


def test_torchs_own_cuda_graph_objects_are_back_after_the_run():
    before = (torch.cuda.CUDAGraph, torch.cuda.graph, torch.cuda.graph_pool_handle, torch.cuda.make_graphed_callables)
    World(1, map_cuda=True).run(lambda comm: None)
    assert (torch.cuda.CUDAGraph, torch.cuda.graph, torch.cuda.graph_pool_handle,
            torch.cuda.make_graphed_callables) == before
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="dummy base class"):
            torch.cuda.graph_pool_handle()
