"""Model families against every cell of the compatibility matrix, in one 2-rank torchrun job.

    torchrun --nproc-per-node 2 tests/family_matrix.py OUT_JSON MODEL [MODEL ...]

Each cell (FSDP version x wrap policy x checkpointing x precision) is applied
to a fresh copy of the model exactly as a trial applies it (autotune.worker:
meta-device build, checkpointing, FSDP, shard-by-shard materialization), then
trains one real step. A cell passes when the loss is finite, the parameters
moved, and tied weights are still one tensor. Cells share the job, not state:
isolation is not the point here, so the matrix costs seconds per family, and
the families share one job's start-up (torch's imports, the process group).
Rank 0 writes ``{model: {cell: "trained" | "error: ..."}}`` to OUT_JSON.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from autotune.config import FsdpConfig
from autotune.worker.fsdp import build_mesh, make_grad_scaler, parallelize
from autotune.worker.models import build_model
from autotune.worker.step_recipe import recipe_for
from autotune.worker.train import train_step

warnings.filterwarnings("ignore")

CELLS = list(itertools.product((1, 2), ("transformer_layer", "size_based", "none"),
                               ("none", "full", "every_other_layer", "selective"), ("fp32", "bf16")))
# Small enough that the size-based threshold wraps some modules and not others.
MIN_NUM_PARAMS = 20_000


def cell_name(cell: tuple) -> str:
    version, wrap, checkpointing, precision = cell
    return f"FSDP{version} {wrap} {checkpointing} {precision}"


def tied_pairs(model: torch.nn.Module) -> list[tuple[tuple, tuple]]:
    """(module, name) pairs that register one parameter twice (a tied embedding and head);
    the modules outlive wrapping, so the tie can be checked on them after a step."""
    first: dict[int, tuple] = {}
    pairs = []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in first:
                pairs.append((first[id(p)], (module, name)))
            else:
                first[id(p)] = (module, name)
    return pairs


def train_cell(model_name: str, cell: tuple) -> None:
    version, wrap, checkpointing, precision = cell
    built = build_model(model_name)
    ties = tied_pairs(built.module)
    cfg = FsdpConfig(fsdp_version=version, auto_wrap_policy=wrap, min_num_params=MIN_NUM_PARAMS,
                     activation_checkpointing=checkpointing, mixed_precision=precision, micro_batch_size=2,
                     transformer_layer_cls=built.layer_classes)
    device = torch.device("cpu")
    mesh = build_mesh("cpu", cfg.sharding_strategy, dist.get_world_size(), 1)
    model = parallelize(built.module, built.layers, cfg.to_dict(), device, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters() if p.numel()]
    recipe = recipe_for(model_name, built.vocab_size, 32)
    tokens = recipe.batch(2, device, seed=dist.get_rank())
    loss = train_step(model, optimizer, recipe, tokens, make_grad_scaler(precision, device))
    if not torch.isfinite(loss).item():
        raise RuntimeError(f"the loss is not finite: {loss.item()}")
    after = [p.detach() for p in model.parameters() if p.numel()]
    moved = torch.tensor([float(any(not torch.equal(a, b) for a, b in zip(before, after)))])
    dist.all_reduce(moved)  # a rank may hold no shard of some parameters; one rank must see a change
    if moved.item() == 0:
        raise RuntimeError("no parameter changed in the optimizer step")
    for (m1, n1), (m2, n2) in ties:
        if getattr(m1, n1) is not getattr(m2, n2):
            raise RuntimeError(f"{type(m1).__name__}.{n1} and {type(m2).__name__}.{n2} were tied and no longer are")


def main(argv: list[str]) -> int:
    out, *model_names = argv
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    results: dict[str, dict[str, str]] = {}
    for model_name, cell in itertools.product(model_names, CELLS):
        try:
            train_cell(model_name, cell)
            outcome = "trained"
        except Exception as exc:  # noqa: BLE001 - every cell's outcome is the product
            outcome = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            if os.environ.get("AUTOTUNE_MATRIX_TRACEBACK"):
                traceback.print_exc()
        results.setdefault(model_name, {})[cell_name(cell)] = outcome
        dist.barrier()
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
