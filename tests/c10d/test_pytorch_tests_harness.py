"""benchmarks/pytorch_tests.py runs PyTorch-style distributed test classes on virtual ranks.

A small test file written here in the form of PyTorch's own (a ``MultiProcessTestCase``
that initialises gloo from its rendezvous file, a ``DTensorTestBase`` with ``with_comms``,
a ``MultiThreadedTestCase``, a single-process ``TestCase``) is run through the harness's
command line; each test's verdict is known from what it does: the collectives' sums, an
assertion that fails on rank 1 only, a ``skip_if_lt_x_gpu`` on this CPU machine.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "benchmarks" / "pytorch_tests.py"

TOY = textwrap.dedent('''
    import unittest

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor, Shard
    from torch.testing._internal.common_distributed import (
        MultiProcessTestCase, MultiThreadedTestCase, skip_if_lt_x_gpu)
    from torch.testing._internal.common_utils import TestCase
    from torch.testing._internal.distributed._tensor.common_dtensor import (
        DTensorTestBase, create_local_tensor_test_class, with_comms)


    class ToyProcessTest(MultiProcessTestCase):
        @property
        def world_size(self):
            return 3

        def _init(self):
            dist.init_process_group("gloo", init_method=f"file://{self.file_name}",
                                    rank=self.rank, world_size=self.world_size)

        def test_sum(self):
            self.assertFalse(dist.is_initialized())      # a fresh process has no group
            self._init()
            t = torch.tensor([float(self.rank + 1)])
            dist.all_reduce(t)
            self.assertEqual(t.item(), 6.0)

        def test_wrong_on_rank_1(self):
            self._init()
            t = torch.tensor([float(self.rank)])
            dist.all_reduce(t)
            if t.item() + (self.rank == 1) != 3.0:
                raise AssertionError(f"rank {self.rank} disagrees: {t.item() + 1}")

        @skip_if_lt_x_gpu(2)
        def test_needs_gpus(self):
            self._init()


    class ToyDTensorTest(DTensorTestBase):
        @property
        def world_size(self):
            return 4

        @with_comms
        def test_full_tensor(self):
            mesh = self.build_device_mesh()
            full = torch.arange(8.0)
            shard = distribute_tensor(full, mesh, [Shard(0)])
            self.assertEqual(shard.to_local(), full[2 * self.rank:2 * self.rank + 2])
            self.assertEqual(shard.full_tensor(), full)


    ToyDTensorTestWithLocalTensor = create_local_tensor_test_class(ToyDTensorTest)


    class ToyThreadTest(MultiThreadedTestCase):
        @property
        def world_size(self):
            return 2

        def test_rank(self):
            self.assertEqual(dist.get_rank(), self.rank)
            self.assertEqual(dist.get_world_size(), 2)


    class ToySingleProcess(TestCase):
        def test_alone(self):
            pass
''')


@pytest.fixture(scope="module")
def harness_output(tmp_path_factory) -> str:
    checkout = tmp_path_factory.mktemp("pytorch")
    test_file = checkout / "test" / "distributed" / "test_toy.py"
    test_file.parent.mkdir(parents=True)
    test_file.write_text(TOY)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(HARNESS), "--pytorch", str(checkout), "--timeout", "60",
                           "distributed/test_toy.py"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _line(output: str, test: str) -> str:
    lines = [line for line in output.splitlines() if line.split()[1:2] == [test]]
    assert len(lines) == 1, output
    return lines[0]


def test_passing_tests_pass(harness_output):
    for test in ("ToyProcessTest.test_sum", "ToyDTensorTest.test_full_tensor", "ToyThreadTest.test_rank"):
        assert _line(harness_output, test).startswith("PASS "), harness_output


def test_a_rank_failing_fails_the_test_with_its_first_error_line(harness_output):
    line = _line(harness_output, "ToyProcessTest.test_wrong_on_rank_1")
    assert line.startswith("FAIL ") and "AssertionError" in line and "rank 1 disagrees" in line, line


def test_gpu_skips_are_skips(harness_output):
    line = _line(harness_output, "ToyProcessTest.test_needs_gpus")
    assert line.startswith("SKIP ") and "CUDA" in line, line


def test_totals_and_single_process_classes(harness_output):
    assert "distributed/test_toy.py | 5 | 3 | 1 | 1" in harness_output, harness_output
    assert "ToySingleProcess: 1 single-process tests, not run here" in harness_output, harness_output
    assert "ToySingleProcess.test_alone" not in harness_output.replace(
        "ToySingleProcess: 1", ""), harness_output


def test_local_tensor_classes_are_listed_as_single_process(harness_output):
    # create_local_tensor_test_class: every rank simulated in one process on a "fake" group
    assert "ToyDTensorTestWithLocalTensor: 1 single-process tests, not run here" in harness_output, \
        harness_output
    assert "ToyDTensorTestWithLocalTensor.test_full_tensor" not in harness_output, harness_output
