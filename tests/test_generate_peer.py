"""The CPU generation benchmark against transformers (``experiments.generate_peer``) at tiny
sizes: our arm alone writes sane JSON; with ``PEER_PYTHON`` (a Python with torch and
transformers, which the test environment lacks) the peer's arm runs too and generates the
same greedy tokens from the same saved model.
"""

import json
import os

import pytest

from experiments import generate_peer

TINY = ["--emb", "16", "--mlp", "16", "--heads", "2", "--kv-heads", "1", "--layers", "1",
        "--vocab", "64", "--experts", "4", "--top-k", "2", "--batch", "2", "--prompt", "5",
        "--new-tokens", "3", "--rounds", "2", "--steps", "1", "--warmup", "1"]


def test_our_arm_alone_writes_its_tokens_per_second_and_tokens(tmp_path):
    out = str(tmp_path / "result.json")
    generate_peer.main([*TINY, "--out", out])
    with open(out) as f:
        result = json.load(f)
    assert list(result["arms"]) == ["ours"] and result["reference"] == "ours"
    ours = result["arms"]["ours"]
    assert ours["step_s"]["n"] == 2 and 0 < ours["step_s"]["min"] <= ours["step_s"]["max"]
    assert ours["tokens_per_s"] == pytest.approx(2 * 3 / ours["step_s"]["median"], rel=1e-12)
    generated = ours["generated"]  # the last call's new tokens: batch rows of new_tokens ids
    assert len(generated) == 2 and all(len(row) == 3 for row in generated)
    assert all(0 <= t < 64 for row in generated for t in row)
    assert result["agreement"]["ours"] == {"rows_equal": 2, "rows": 2, "first_difference": None}
    assert result["sizes"]["tokens"] == 6 and result["command"].startswith(
        "python -m experiments.generate_peer --emb 16")
    assert ours["ready"]["backend"] == "cpu" and ours["ready"]["num_params"] > 0


@pytest.mark.skipif(not os.environ.get("PEER_PYTHON"),
                    reason="PEER_PYTHON (a Python with torch and transformers) not given")
def test_the_peer_generates_our_greedy_tokens(tmp_path):
    out = str(tmp_path / "result.json")
    result = generate_peer.main([*TINY, "--peer-python", os.environ["PEER_PYTHON"],
                                 "--peer-experts", "eager", "--out", out])
    assert result["reference"] == "peer_eager"
    assert result["arms"]["peer_eager"]["ready"]["num_params"] == \
        result["arms"]["ours"]["ready"]["num_params"]
    # Three greedy tokens of a random model: a near tie that float rounding flips is possible
    # in principle; rows agreeing is what both sides computing the same model gives.
    assert result["agreement"]["ours"]["rows_equal"] == 2
    assert "PEER_PYTHON" in result["command"]
