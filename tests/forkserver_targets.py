"""Targets the fork server runs in tests: ``tests.forkserver_targets:NAME``."""

import json
import os
import sys
import time


def report(argv: list[str]) -> int:
    """Print what the forked process sees, then exit with the code argv[0] names."""
    print(json.dumps({"argv": argv, "cwd": os.getcwd(), "marker": os.environ.get("AUTOTUNE_TEST_MARKER"),
                      "pid": os.getpid(), "sid": os.getsid(0), "affinity": sorted(os.sched_getaffinity(0)),
                      "torch_loaded": "torch" in sys.modules}))
    return int(argv[0])


def sleep(argv: list[str]) -> None:
    print(os.getpid(), flush=True)
    time.sleep(float(argv[0]))


def crash(argv: list[str]) -> None:
    raise RuntimeError("boom from a forked target")


def count_linear_work(argv: list[str]) -> None:
    """The work counter on a Linear(16 -> 32, no bias) and a ReLU over 8 x 16 fp32 inputs, forward and backward:
    printed as one region's Work dict each."""
    import torch

    from autotune.worker.step_moments import StepMoments
    from autotune.worker.work_counter import WorkCounter

    model = torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), torch.nn.ReLU())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    moments = StepMoments(model, optimizer, [model[0]]).watch(1)
    counter = WorkCounter(moments, micro_batch_size=1, seq_len=8,
                          param_shapes=frozenset(tuple(p.shape) for p in model.parameters()))
    x = torch.randn(8, 16)
    with moments.saved_tensors_hooks(), counter:
        model(x).sum().backward()
    print(json.dumps({key: work.to_dict() for key, work in counter.regions.items()}))


def count_conv_work(argv: list[str]) -> None:
    """The work counter on a Conv2d(3 -> 8, 3x3) over 2 x 3 x 16 x 16 fp32, forward only: one region's Work."""
    import torch

    from autotune.worker.step_moments import StepMoments
    from autotune.worker.work_counter import WorkCounter

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, bias=False))
    moments = StepMoments(model, torch.optim.SGD(model.parameters(), lr=0.1), [model[0]]).watch(1)
    counter = WorkCounter(moments, micro_batch_size=2, seq_len=16)
    with torch.no_grad(), counter:
        model(torch.randn(2, 3, 16, 16))
    print(json.dumps({key: work.to_dict() for key, work in counter.regions.items()}))
