"""The scripts that wrap jaxlp.evals, jaxlp.testbed.training and jaxlp.models.gguf: each parses its
command line (``--help`` exits 0 and names its flags) in a fresh interpreter."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
FLAGS = {  # script -> flags its --help must list
    "eval_reasoner": ("--quick", "--list", "--max-cache-groups", "--time-limit"),
    "entropy_analysis": ("--kind", "--bins-per-decade", "--min-token-count"),
    "kvcache_eval": ("--caches", "--prefill", "--chunk"),
    "quality_report": ("--recipes", "--calibration-sequences"),
    "reset_trace_plot": ("--problem", "--tau0", "--t-low"),
    "train_reasoner": ("--tiny", "--snapshots", "--ship-min-accuracy", "--order-window"),
    "convert_gemma3_gguf": ("--out", "--force"),
}


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPTS / f"{name}.py"), *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("name", sorted(FLAGS))
def test_help(name):
    result = run_script(name, "--help")
    assert result.returncode == 0, result.stderr
    assert all(flag in result.stdout for flag in FLAGS[name])


def test_eval_reasoner_rejects_an_unknown_table_and_lists_programs():
    bad = run_script("eval_reasoner", "--tables", "3")
    assert bad.returncode == 2 and "unknown table '3'; choose from 1, 2, 5" in bad.stderr
    listed = run_script("eval_reasoner", "--list", "--tables", "2")
    assert listed.returncode == 0 and listed.stdout.splitlines()[-1] == "2 compiled programs, 32 configs"
