"""The commands the project is specified by, run as a user types them.

``configs/wmt_n4.py`` and its siblings name one variant of ``configs/wmt.py`` or
``configs/electra.py`` each, so both spellings of a setting give the same config.
"""

import glob
import os
import subprocess
import sys

import pytest

from sparsemixer_jax.data import sources
from sparsemixer_jax.tasks import check_config
from sparsemixer_jax.training import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WMT_VARIANTS = ("dense", "n2", "n4", "n6", "n8", "n16")
ELECTRA_VARIANTS = ("dense", "n2", "n4", "n8")
SETTINGS = [("wmt", v) for v in WMT_VARIANTS] + [("electra", v) for v in ELECTRA_VARIANTS]


def load(spec: str):
    """A config as ``--config=spec`` loads it (relative paths from the repository's root)."""
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        return cli.load_config_file(spec)
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize(("family", "variant"), SETTINGS)
def test_each_setting_file_is_its_variant_of_the_family_config(family, variant):
    by_file = load(f"configs/{family}_{variant}.py")
    by_variant = load(f"configs/{family}.py:{variant}")
    assert by_file.to_dict() == by_variant.to_dict()
    check_config(by_file)
    experts = 0 if variant == "dense" else int(variant[1:])
    assert by_file.model.num_experts == experts


def test_every_setting_file_is_tested():
    """A new ``wmt_*.py`` or ``electra_*.py`` setting file joins the list above."""
    named = {f"{family}_{variant}.py" for family, variant in SETTINGS}
    on_disk = {os.path.basename(p) for p in glob.glob(os.path.join(REPO, "configs", "*_*.py"))
               if os.path.basename(p).split("_", 1)[1][:-3] in {*WMT_VARIANTS, *ELECTRA_VARIANTS}}
    assert on_disk == named


def test_a_wrong_variant_or_file_is_one_line_naming_the_valid_ones():
    argv = ["wmt", "--workdir", "/tmp/unused", "--config"]
    assert cli.config_file_error([*argv, "configs/wmt_n4.py"]) is None
    assert cli.config_file_error([*argv, "configs/wmt.py:n5"]) == (
        "--config=configs/wmt.py:n5: unknown variant 'n5'; choose one of dense, n2, n4, n6, n8, "
        "n16")
    assert cli.config_file_error([*argv, "configs/electra.py:n16"]) == (
        "--config=configs/electra.py:n16: unknown variant 'n16'; choose one of dense, n2, n4, n8")
    missing = cli.config_file_error([*argv, "configs/wmt_n5.py"])
    assert missing.startswith("--config=configs/wmt_n5.py: no such config file 'configs/wmt_n5.py'")
    assert "wmt_n4.py" in missing
    assert cli.config_file_error([*argv, "configs/quickstart.py:n4"]) == (
        "--config=configs/quickstart.py:n4: configs/quickstart.py has no variants; use "
        "--config=configs/quickstart.py")
    run = subprocess.run([sys.executable, "-m", "experiments.wmt", "--config", "configs/wmt.py:n5",
                          "--workdir", "/tmp/unused"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "error: --config=configs/wmt.py:n5: unknown variant 'n5'; choose one of dense, n2, n4, "
        "n6, n8, n16"]


def test_the_design_card_command_reaches_the_data_step(tmp_path):
    """``python -m experiments.wmt --config configs/wmt_n4.py`` parses, validates, writes its
    config and asks TFDS for WMT'14; offline, that ends in one line within seconds."""
    if sources.download_servers_reachable("wmt14_translate/de-en"):
        pytest.skip("this machine reaches WMT's download servers: the command would download it")
    env = {**os.environ, "TFDS_DATA_DIR": str(tmp_path / "tfds")}
    workdir = tmp_path / "wmt_n4"
    run = subprocess.run(
        [sys.executable, "-m", "experiments.wmt", "--config", "configs/wmt_n4.py", "--workdir",
         str(workdir)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr[-2000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: TFDS dataset 'wmt14_translate/de-en' is not prepared in {tmp_path}/tfds/"
        "wmt14_translate/de-en/1.0.0 and its download servers cannot be reached from this "
        "machine; prepare it on a machine with network access and copy it over, then point "
        "config.data.dir (or TFDS_DATA_DIR) at the copy (docs/translation.md, 'WMT'14 without "
        "network')"]
    assert "Traceback" not in run.stderr
    assert (workdir / "config.json").exists()
    # Nothing left behind that a rerun would trip over: no partial download, no checkpoint.
    assert not (tmp_path / "tfds" / "downloads").exists()
    assert sorted(p.name for p in workdir.iterdir()) == ["config.json", "lock"]
    assert (workdir / "lock").read_text() == ""  # released: the one-run-per-workdir lock
