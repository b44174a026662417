"""Backend choice, device placement and joining a torchrun job (no processes started here)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import real

pytestmark = pytest.mark.real


def test_pick_backend():
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert real.pick_backend(gpus + 1) == "gloo"                   # more ranks than GPUs: gloo
    if gpus:
        assert real.pick_backend(gpus) == "nccl"
    assert real.pick_backend(2, "GLOO") == "gloo"
    with pytest.raises(ValueError, match="backend='ucc' is not supported"):
        real.pick_backend(2, "ucc")
    with pytest.raises(ValueError, match=f"{gpus + 1} ranks on this node but {gpus} CUDA device"):
        real.pick_backend(gpus + 1, "nccl")


def test_device_for_gloo_is_cpu():
    assert real.device_for("gloo", 3) == torch.device("cpu")


def test_init_from_env_outside_torchrun_names_the_missing_variables(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"\['RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT'\] are not set"):
        real.init_from_env()


def test_transport_needs_a_group():
    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    with pytest.raises(ValueError, match="not a member of the given group"):
        real.DistTransport()
