"""``python -m real.bench``: sizes, the report, and real gloo runs (clean, and with a corrupted rank)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from real import bench
from simcomm import ops
from simcomm.model import cost

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["-b", "1K", "-e", "4K", "-f", "4", "-n", "2", "-w", "1"]


def test_parse_size_and_sizes_follow_nccl_tests():
    assert [bench.parse_size(s) for s in ("8", "32K", "128M", "1G", "2kb")] == [8, 32768, 128 << 20, 1 << 30,
                                                                             2048]
    assert bench.sizes(8, 128, 2) == [8, 16, 32, 64, 128]
    assert bench.sizes(1024, 5000, 4) == [1024, 4096]
    with pytest.raises(ValueError, match="'12X'"):
        bench.parse_size("12X")
    with pytest.raises(ValueError, match="-b 64 -e 8"):
        bench.sizes(64, 8, 2)
    with pytest.raises(ValueError, match="-f.*1"):
        bench.sizes(8, 64, 1)


@pytest.mark.parametrize("op, size, world_size, expected", [
    ("all_reduce", 1000, 4, (250, 250)),          # per-rank buffer
    ("broadcast", 6, 4, (1, 1)),                  # at least one element
    ("all_gather", 1000, 4, (248, 62)),           # whole output, rounded to whole elements per rank
    ("reduce_scatter", 1000, 4, (248, 248)),      # whole input
    ("all_to_all", 64, 4, (16, 16)),
    ("send_recv", 64, 2, (16, 16)),
])
def test_size_to_elements(op, size, world_size, expected):
    assert bench._shape(op, size, world_size, 4) == expected
    # one convention: the elements make up the cost model's size for the rank's input
    count, in_count = expected
    assert cost.nccl_size(op, in_count * 4, world_size) == count * 4


def test_ops_accept_the_vocabulary_spellings():
    config = bench._config(bench._parser().parse_args(["--ops", "allreduce, all-gather,sendrecv", *SMALL]))
    assert config["ops"] == ["all_reduce", "all_gather", "send_recv"]
    assert set(bench.OPS) <= set(ops.COST_OPS)


def _rows(wrong):
    return [{"op": "all_reduce", "size": 1024, "count": 256, "type": "float", "time_us": 20.0,
             "algbw": 0.0512, "busbw": 0.0768, "wrong": wrong}]


def test_report_columns_model_and_verdict():
    meta = {"world_size": 4, "backend": "gloo", "iters": 2, "warmup": 1, "check": True, "model": None}
    text = bench.format_report(_rows(0), meta)
    assert "#wrong" in text and "busbw" in text and "algbw" in text
    assert "1024" in text and "0.077" in text and "Out of bounds values : 0 OK" in text
    assert "FAILED" in bench.format_report(_rows(3), meta)
    rows = bench._with_model(_rows(0), 4, "h100-nvswitch")
    modelled = bench.format_report(rows, {**meta, "model": "h100-nvswitch"})
    assert rows[0]["model"]["preset"] == "h100-nvswitch" and rows[0]["model"]["time_us"] > 0
    assert "model h100-nvswitch" in modelled and "(t/m)" in modelled


def test_cli_rejects_bad_arguments():
    with pytest.raises(SystemExit, match="unknown --ops.*all_reduc"):
        bench.main(["--ops", "all_reduc", *SMALL])
    with pytest.raises(SystemExit, match="--model pcie-2gpu has 2 GPUs.*4 ranks"):
        bench.main(["--nproc", "4", "--backend", "gloo", "--model", "pcie-2gpu", *SMALL])


@pytest.mark.real
def test_two_gloo_ranks_print_the_table_with_nothing_wrong(tmp_path):
    printed: list[str] = []
    path = tmp_path / "bench.json"
    status = bench.main(["--nproc", "2", "--backend", "gloo", "--model", "pcie-2gpu", "--json", str(path),
                         *SMALL], out=printed.append)
    text = "\n".join(printed)
    assert status == 0, text
    for op in bench.OPS:
        assert f"# {op}" in text
    assert "Out of bounds values : 0 OK" in text
    data = json.loads(path.read_text())
    assert data["world_size"] == 2 and data["backend"] == "gloo" and data["model"] == "pcie-2gpu"
    assert {(row["op"], row["size"]) for row in data["rows"]} == {(op, s) for op in bench.OPS
                                                                  for s in (1024, 4096)}
    for row in data["rows"]:
        assert row["wrong"] == 0
        assert row["time_us"] > 0 and row["busbw"] > 0
        assert row["model"]["busbw"] > 0


@pytest.mark.real
def test_a_corrupted_rank_is_reported_wrong():
    """Rank 1's input is off by one: every output that depends on it is counted wrong."""
    env = {**os.environ, bench.CORRUPT_ENV: "1"}
    done = subprocess.run([sys.executable, "-m", "real.bench", "--nproc", "2", "--backend", "gloo",
                           "-b", "1K", "-e", "1K", "-n", "1", "-w", "0"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    wrong = {}
    section = None
    for line in done.stdout.splitlines():
        if line.startswith("# ") and line[2:] in bench.OPS:
            section = line[2:]
        elif line.strip() and not line.startswith("#"):
            wrong[section] = int(line.split()[6])
    count = 256                                   # 1 KiB of float32
    assert wrong == {
        "all_reduce": 2 * count,                  # every element on both ranks
        "all_gather": count // 2 * 2,             # rank 1's chunk, on both ranks
        "reduce_scatter": count // 2 * 2,         # every rank's chunk sums rank 1's input
        "all_to_all": count // 2 * 2,             # the chunk each rank receives from rank 1
        "broadcast": 0,                           # only the root's (rank 0's) input is sent
        "send_recv": count,                       # what rank 0 receives from rank 1
    }
    assert "FAILED" in done.stdout


@pytest.mark.real
def test_runs_under_torchrun():
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", "-m", "real.bench", "--backend", "gloo",
                           "--ops", "all_reduce,send_recv", *SMALL],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("# real.bench  nranks 2") == 1      # printed by rank 0 only
    assert "# all_reduce" in done.stdout and "# send_recv" in done.stdout
    assert "Out of bounds values : 0 OK" in done.stdout
