"""Predict a configuration's peak memory per rank without the hardware.

One real training step runs under ``FakeTensorMode`` with PyTorch's ``fake``
process group: the model is built, checkpointed and wrapped with FSDP1 or FSDP2
exactly as a trial does it, at the real world size, but every tensor is fake, so
nothing is allocated and no collective moves data. The live-storage tracker the
CPU trials use counts the fake tensors, so the prediction and the CPU
measurement are the same quantity. Saved-tensor hooks tell activations apart.

``python -m autotune.worker.fake_step --serve`` answers one JSON request per
line on stdin with one JSON line on stdout, so the driver pays the imports once.
"""

from __future__ import annotations

import gc
import json
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils.weak import WeakIdKeyDictionary

from autotune.config import FsdpConfig, LoraSpec, accumulation_steps
from autotune.worker.fsdp import build_mesh, make_grad_scaler, parallelize
from autotune.worker.measure import LiveStorageTracker
from autotune.worker.models import BuiltModel, apply_lora, block_count, build_model
from autotune.worker.train import accumulate, make_optimizer, train_step

METHOD = "fake_tensor_step"


class BreakdownTracker(LiveStorageTracker):
    """The live-storage peak, split by what each storage holds at that moment."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(count_fake=True)
        self.model = model
        self.optimizer = optimizer
        self.saved: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.breakdown: dict[str, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        try:
            self.saved[tensor.untyped_storage()] = None
        except (RuntimeError, NotImplementedError):
            pass
        return tensor

    def _update_peak(self) -> None:
        before = self.peak_bytes
        super()._update_peak()
        if self.peak_bytes > before:
            self.breakdown = self._split()

    def _split(self) -> dict[str, int]:
        def storages(tensors) -> dict[int, Any]:
            found = {}
            for t in tensors:
                local = getattr(t, "_local_tensor", t)
                try:
                    s = local.untyped_storage()
                except (RuntimeError, NotImplementedError):
                    continue
                found[id(s)] = s
            return found

        params = storages(self.model.parameters())
        grads = storages(p.grad for p in self.model.parameters() if p.grad is not None)
        state = storages(v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
        saved = {id(s): s for s in list(self.saved.keys())}
        seen: set[int] = set()
        split = {}
        for name, group in (("parameters", params), ("gradients", grads), ("optimizer_state", state), ("activations", saved)):
            split[name] = sum(s.nbytes() for k, s in group.items() if k not in seen)
            seen.update(group)
        split["temporaries"] = max(0, self.peak_bytes - sum(split.values()))
        return split


def add_fake_adapters(built: BuiltModel, lora: LoraSpec) -> None:
    """LoRA's adapters on a fake-tensor model, as :func:`apply_lora` puts them on a trial's.

    peft moves each new adapter to its base layer's device with ``.to()``,
    which cannot swap a fake parameter (torch 2.13: "Couldn't swap
    Linear.weight"). So peft runs outside the fake mode, making its adapters
    on the meta device, and each gets fake storage of its shape here.
    """
    with unset_fake_temporarily():
        built.module, built.lora_targets = apply_lora(built.module, lora)
    for module in built.module.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                fake = torch.empty(param.shape, dtype=param.dtype, device="cpu")
                module.register_parameter(name, torch.nn.Parameter(fake, requires_grad=param.requires_grad))


def fake_train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, scaler,
                    micro_batches: int = 1) -> None:
    """``train_step`` as a fake tensor can run it.

    The grad scaler's ``step`` and ``update`` read whether any gradient was
    inf (a data-dependent ``.item()``), which fake tensors cannot answer. The
    scaler's public pieces do the same work without that read: unscale (its
    inverse scale, the found-inf flag and their all-reduce are counted), the
    optimizer step a finite step takes, and the scale reset to a given value.
    """
    if scaler is None:
        train_step(model, optimizer, tokens, scaler, micro_batches)
        return
    accumulate(model, tokens, micro_batches, scaler)
    scaler.unscale_(optimizer)
    optimizer.step()
    scaler.update(new_scale=FP16_SCALE)
    optimizer.zero_grad(set_to_none=True)


def create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's state as its first step creates it (a step count, two moments per
    parameter), without that step: a fake step costs a second or two, and a
    first training step gave the same peak as this, to within 136 bytes, over
    FSDP1 and FSDP2, every sharding, checkpointing and precision, with and
    without gradient accumulation."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                optimizer.state[p] = {"step": torch.tensor(0.0),
                                      "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                      "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


# Any value will do: the scale is one float, whatever it holds.
FP16_SCALE = 2.0**16


def estimate(model: str, world_size: int, nnodes: int, seq_len: int, cfg: FsdpConfig, grad_accum_steps: int = 1,
             num_blocks: int | None = None, lora: LoraSpec | None = None) -> dict[str, Any]:
    """Peak bytes per rank of one steady-state training step, and its breakdown.

    With gradient accumulation the step runs two micro batches, the first
    unsynced: from the second on, the accumulated unsharded gradients are held
    as they are in every later one, so two show the peak of any number."""
    micro_batches = min(grad_accum_steps, 2)
    if world_size % nnodes:
        raise ValueError(f"world size {world_size} is not a multiple of nnodes {nnodes}")
    start = time.perf_counter()
    if not dist.is_initialized() or dist.get_world_size() != world_size:
        if dist.is_initialized():
            dist.destroy_process_group()
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    # The mesh is real metadata; only tensors are fake.
    mesh = build_mesh("cpu", cfg.sharding_strategy, world_size, nnodes, cfg.shard_group_size)
    with FakeTensorMode(allow_non_fake_inputs=True):
        built = build_model(model, cfg.transformer_layer_cls, device="cpu", num_blocks=num_blocks)
        if lora is not None:
            add_fake_adapters(built, lora)
        num_params = built.count_parameters()[0]
        wrapped = parallelize(built.module, built.layers, cfg.to_dict(), torch.device("cpu"), mesh)
        optimizer = make_optimizer(wrapped)
        scaler = make_grad_scaler(cfg.mixed_precision, torch.device("cpu"))
        tokens = torch.randint(0, built.vocab_size, (cfg.micro_batch_size, seq_len))
        # The step measured is a steady one: its optimizer state exists before it starts.
        create_optimizer_state(optimizer)
        tracker = BreakdownTracker(wrapped, optimizer)
        with torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda t: t), tracker:
            fake_train_step(wrapped, optimizer, tokens, scaler, micro_batches)
    result = {"peak_bytes": tracker.peak_bytes, "breakdown": tracker.breakdown, "method": METHOD,
              "seconds": round(time.perf_counter() - start, 3),
              "num_params": num_params}
    del tracker, optimizer, wrapped, built, tokens
    gc.collect()
    return result


# Models with at least this many blocks are estimated from 3- and 4-block copies;
# shallower ones run whole, which costs little more.
EXTRAPOLATE_FROM_BLOCKS = 8


def extrapolation_points(cfg: FsdpConfig) -> tuple[int, int]:
    """The two depths to run: consecutive, except that checkpointing every
    other block repeats in pairs, so its copies differ by one pair. Not 2:
    with two blocks the first block's and the last block's special cases (the
    last one is not resharded after forward, backward starts on it) overlap at
    the peak, and 2 -> 3 grew 19% more than any later block did (HSDP with
    selective checkpointing on llama-tiny); from 3 on every step was the same."""
    return (4, 6) if cfg.activation_checkpointing == "every_other_layer" else (3, 4)


def estimate_step(model: str, world_size: int, nnodes: int, seq_len: int, cfg: FsdpConfig, grad_accum_steps: int = 1,
                  exact: bool = False, lora: LoraSpec | None = None) -> dict[str, Any]:
    """The fake step's peak and breakdown, from the whole model or, for a deep
    one, extrapolated from two shallow copies.

    Every figure of the step is affine in the number of identical blocks:
    parameters, gradients, optimizer state and saved activations grow by one
    block's worth per block, and the transient at the peak (one unit
    unsharded, one block's recomputation, the optimizer's scratch) is the same
    shape whatever the depth. So peak(L) = peak(3) + (L - 3) * (peak(4) - peak(3)),
    at the cost of seven blocks instead of L (ten when checkpointing every
    other block, whose unit is a pair). ``exact`` runs all L
    (``autotune estimate --exact``; benchmarks/estimator_accuracy.py compares the two).
    """
    blocks = None if exact else block_count(model)
    low_n, high_n = extrapolation_points(cfg)
    # Only where the two copies together are shallower than the model itself.
    if blocks is None or blocks < max(EXTRAPOLATE_FROM_BLOCKS, low_n + high_n + 1):
        return estimate(model, world_size, nnodes, seq_len, cfg, grad_accum_steps, lora=lora)
    start = time.perf_counter()
    low = estimate(model, world_size, nnodes, seq_len, cfg, grad_accum_steps, num_blocks=low_n, lora=lora)
    high = estimate(model, world_size, nnodes, seq_len, cfg, grad_accum_steps, num_blocks=high_n, lora=lora)

    def at_depth(a: int, b: int) -> int:
        return round(a + (blocks - low_n) * (b - a) / (high_n - low_n))

    breakdown = {k: max(0, at_depth(low["breakdown"].get(k, 0), high["breakdown"].get(k, 0)))
                 for k in high["breakdown"]}
    return {"peak_bytes": at_depth(low["peak_bytes"], high["peak_bytes"]), "breakdown": breakdown,
            "method": f"{METHOD}+extrapolated({low_n},{high_n}->{blocks})",
            "seconds": round(time.perf_counter() - start, 3),
            "num_params": at_depth(low["num_params"], high["num_params"])}


def estimate_config(model: str, world_size: int, nnodes: int, seq_len: int, cfg: FsdpConfig,
                    grad_accum_steps: int = 1, exact: bool = False, lora: LoraSpec | None = None) -> dict[str, Any]:
    """``estimate``, with derived figures where a fake step cannot run the configuration.

    - CPU offload cannot be set up on a host without an accelerator: the step
      runs without it, and the sharded parameters, gradients and optimizer
      state, which offload keeps in host memory, are taken off the peak.
    - torch.compile does not run under fake tensors: the eager step stands in.
    - FSDP1 SHARD_GRAD_OP (and HYBRID_SHARD_ZERO2) fails under fake tensors
      in PyTorch's flat-parameter bookkeeping: the step runs as FULL_SHARD,
      and the unsharded parameters that SHARD_GRAD_OP keeps from forward to
      backward are added (all of them but this rank's shard, in the compute dtype).
    """
    notes = []
    run_cfg = cfg
    if cfg.compile:
        # Fake tensors do not run inductor, whose fused kernels hold fewer
        # intermediate buffers than eager: the eager step's peak stands in, as
        # an upper side, with the wider slack of a derived figure.
        run_cfg = run_cfg.replace(compile=False)
        notes.append("compile_as_eager")
    if cfg.cpu_offload:
        run_cfg = run_cfg.replace(cpu_offload=False)
        notes.append("offload")
    zero2 = cfg.fsdp_version == 1 and cfg.sharding_strategy in ("SHARD_GRAD_OP", "HYBRID_SHARD_ZERO2")
    if zero2:
        run_cfg = run_cfg.replace(sharding_strategy="FULL_SHARD" if cfg.sharding_strategy == "SHARD_GRAD_OP" else "HYBRID_SHARD")
    result = estimate_step(model, world_size, nnodes, seq_len, run_cfg, grad_accum_steps, exact, lora)
    if zero2:
        num_params = result.pop("num_params")
        itemsize = 4 if cfg.mixed_precision == "fp32" else 2
        shard_groups = (cfg.shard_group_size or world_size // nnodes) if cfg.is_hybrid else world_size
        kept = int(num_params * itemsize * (1 - 1 / shard_groups))
        result["peak_bytes"] += kept
        result["breakdown"]["temporaries"] += kept
        notes.append("fsdp1_shard_grad_op")
    if cfg.cpu_offload:
        breakdown = result["breakdown"]
        moved = breakdown["parameters"] + breakdown["gradients"] + breakdown["optimizer_state"]
        result["peak_bytes"] -= moved
        breakdown.update(parameters=0, gradients=0, optimizer_state=0)
    result.pop("num_params", None)
    if notes:
        result["method"] += f"+derived({','.join(notes)})"
    return result


def answer(request: dict[str, Any]) -> dict[str, Any]:
    try:
        cfg = FsdpConfig.from_dict(request["fsdp"])
        world_size = int(request["world_size"])
        accum = accumulation_steps(request.get("global_batch_size"), cfg.micro_batch_size, world_size)
        lora = LoraSpec.from_dict(request["lora"]) if request.get("lora") else None
        return estimate_config(request["model"], world_size, int(request.get("nnodes", 1)), int(request["seq_len"]), cfg,
                               accum, exact=bool(request.get("exact", False)), lora=lora)
    except Exception as exc:  # noqa: BLE001 - one bad configuration must not end the server
        return {"error": f"{type(exc).__name__}: {exc}"}


def answer_in_child(request: dict[str, Any]) -> dict[str, Any]:
    """Estimate in a forked child: imports are paid once by the server, and no
    tensor, hook or process group of one estimate can leak into the next."""
    import os

    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        try:
            data = json.dumps(answer(request)).encode()
        except BaseException as exc:  # noqa: BLE001
            data = json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
        with os.fdopen(write_fd, "wb") as pipe:
            pipe.write(data)
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        return {"error": f"the estimating process died (wait status {status})"}
    return json.loads(data)


def main(argv: list[str]) -> int:
    warnings.filterwarnings("ignore")
    if argv == ["--serve"]:
        # Import once here, so each forked estimate starts with them loaded.
        import transformers  # noqa: F401
        from transformers.models.llama import modeling_llama  # noqa: F401

        for line in sys.stdin:
            if line.strip():
                print(json.dumps(answer_in_child(json.loads(line))), flush=True)
        return 0
    if len(argv) == 1:
        # A request inline (as the fork server passes it) or in a file.
        text = argv[0] if argv[0].lstrip().startswith("{") else open(argv[0]).read()
        print(json.dumps(answer(json.loads(text))))
        return 0
    print("usage: python -m autotune.worker.fake_step (--serve | REQUEST_JSON | REQUEST_FILE)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
