"""Every configuration the space offers trains on every common model family (or is ruled out before launch).

The compatibility matrix: small transformers config.json files of seven
families (tests/families/), each against FSDP version x wrap policy x
checkpointing x precision, one real training step per cell on 2 ranks, every
cell of every family in one torchrun job (tests/family_matrix.py): one
start-up instead of seven, 10 s each under the suite's load.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.config import FsdpConfig
from autotune.launch.host import HostInfo, host_incompatibility
from tests.conftest import REPO

FAMILIES = sorted(p.stem for p in (REPO / "tests" / "families").glob("*.json"))
CELLS = [(v, w, ac, mp) for v in (1, 2) for w in ("transformer_layer", "size_based", "none")
         for ac in ("none", "full", "every_other_layer", "selective") for mp in ("fp32", "bf16")]
CPU = HostInfo(device_type="cpu", cuda_device_count=0, cpu_count=2, device_name=None, device_memory_bytes=None,
               bf16_supported=True, fp16_supported=True, bf16_speedup=1.0, torch_version="2.x",
               transformers_version="5.x")


def test_the_matrix_covers_seven_families_with_ties_experts_and_other_attention_codes():
    assert {"llama", "llama-tied", "gpt2", "qwen2", "mistral", "mixtral", "gemma"} <= set(FAMILIES)
    tied = [f for f in FAMILIES if json.loads((REPO / "tests" / "families" / f"{f}.json").read_text())
            .get("tie_word_embeddings", f in ("gpt2", "gemma"))]
    assert {"llama-tied", "qwen2", "gpt2", "gemma"} <= set(tied)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> dict[str, dict[str, str]]:
    out = tmp_path_factory.mktemp("matrix") / "cells.json"
    models = [str(REPO / "tests" / "families" / f"{family}.json") for family in FAMILIES]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(REPO / "tests" / "family_matrix.py"), str(out), *models],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {Path(model).stem: cells for model, cells in json.loads(out.read_text()).items()}


@pytest.mark.torchrun
@pytest.mark.parametrize("family", FAMILIES)
def test_every_cell_trains_or_is_ruled_out_with_its_reason(family, matrix):
    results = matrix[family]
    assert len(results) == len(CELLS)
    for (version, wrap, checkpointing, precision) in CELLS:
        outcome = results[f"FSDP{version} {wrap} {checkpointing} {precision}"]
        cfg = FsdpConfig(fsdp_version=version, auto_wrap_policy=wrap, activation_checkpointing=checkpointing,
                         mixed_precision=precision, transformer_layer_cls=("Block",))
        ruled_out = host_incompatibility(cfg, CPU, 1, 2)
        assert outcome == "trained" or ruled_out, f"{family}: FSDP{version} {wrap} {checkpointing} {precision}: {outcome}"
