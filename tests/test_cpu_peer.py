"""The side-by-side CPU benchmark's driver (lab.benchmarks.cpu_peer) on stand-in workers.

The workers are tiny Python processes that speak the protocol and report fixed step times, so
the statistics are exact and nothing is timed or slept."""

import sys

import pytest

from lab.benchmarks.cpu_peer import Arm, bench_cpu_peer, table

SIZES = {"tokens": 2048}
# Reports ``seconds`` for every step it is asked to run; ``loss`` counts the steps run so far.
WORKER = """
import json, sys
seconds = float(sys.argv[1])
print(json.dumps({"ready": {"seconds": seconds}}), flush=True)
done = 0
for line in sys.stdin:
    n = json.loads(line)["steps"]
    done += n
    print(json.dumps({"times": [seconds] * n, "cpu_times": [2 * seconds] * n,
                      "loss": float(done)}), flush=True)
"""


def stand_in(name: str, seconds: float, peer: bool = False) -> Arm:
    return Arm(name, (sys.executable, "-c", WORKER, str(seconds)), peer=peer)


def test_ratios_are_to_the_first_peer_arm():
    arms = [stand_in("ours", 0.25), stand_in("peer", 0.125, peer=True),
            stand_in("peer_other", 0.5, peer=True)]
    result = bench_cpu_peer(arms, SIZES, rounds=3, steps=2, warmup=1)
    assert result["reference"] == "peer"
    ours = result["arms"]["ours"]
    assert ours["tokens_per_s"] == 2048 / 0.25
    assert ours["to_reference"]["ratio"] == 0.5  # half the peer's tokens/s
    assert ours["to_reference"]["paired"] == {"median": 0.5, "min": 0.5, "max": 0.5, "n": 3}
    assert result["arms"]["peer_other"]["to_reference"]["ratio"] == 0.25
    assert ours["cpu_s"]["median"] == 0.5
    assert ours["loss"] == 1 + 3 * 2  # warm-up and every round's steps ran, in one process
    assert ours["ready"] == {"seconds": 0.25}
    lines = table(result).splitlines()
    assert lines[2].startswith("| ours | 250 (250-250) | 8,192 |")
    assert "| 0.500 | 0.500 (0.500-0.500) |" in lines[2]


def test_a_worker_that_dies_is_named():
    dead = Arm("broken", (sys.executable, "-c", "import sys; sys.exit(3)"))
    with pytest.raises(RuntimeError, match="arm 'broken' exited with 3"):
        bench_cpu_peer([stand_in("peer", 0.1, peer=True), dead], SIZES, 1, 1, 0)
