"""The pauses between launches of a study whose memory gate works: the driver's planning between two trials.

    python benchmarks/launch_gaps.py [--quick] [--repeats N] [--out benchmarks/results/launch_gaps_cpu.md]

Runs ``autotune run`` on a small Qwen2-style ``config.json`` (4 blocks of hidden
size 256, tied embeddings, 2 ranks, seq len 128) at a budget of 60 MiB, where
about half of the space is predicted not to fit: 8 launches, no confirmation
rounds. For each launch after the first, the gap is the time from the end of
the previous trial to the start of this one (``started_at`` - ``ended_at``
in the record): what the driver spends deciding, mostly fake steps of the
memory estimate that a launch waits for. Also the wait before the first launch
(the run's start to it) and the whole run. Target: no gap over 10 s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reporting import machine, publish, run_tuner  # noqa: E402

QWEN2 = {"model_type": "qwen2", "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096, "max_position_embeddings": 2048,
         "tie_word_embeddings": True}
BUDGET = "60MiB"
TARGET_S = 10.0


def one_run(launches: int) -> dict:
    from autotune.study.record import Attr, StudyAttr

    work = Path(tempfile.mkdtemp(prefix="autotune-gaps-"))
    model = work / "qwen2-small.json"
    model.write_text(json.dumps(QWEN2))
    start = time.time()
    study, wall, _ = run_tuner(work, "--mem-budget", BUDGET, "--model", str(model), "--seq-len", "128",
                               "--trials", str(launches), "--confirm", "0", timeout=1800)
    launched = sorted((t for t in study.trials if Attr.STARTED_AT in t.user_attrs),
                      key=lambda t: t.user_attrs[Attr.STARTED_AT])
    gaps = [(b.user_attrs[Attr.LABEL], b.user_attrs[Attr.STARTED_AT] - a.user_attrs[Attr.ENDED_AT])
            for a, b in zip(launched, launched[1:])]
    costs = study.user_attrs.get(StudyAttr.ESTIMATE_COSTS, {})
    return {"gaps": gaps, "first_launch_s": launched[0].user_attrs[Attr.STARTED_AT] - start, "wall_s": wall,
            "launches": len(launched), "fake_steps": costs.get("fake_steps"), "waited_s": costs.get("estimate_wait_s")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 launches, one run")
    parser.add_argument("--repeats", type=int, default=2, help="runs of the study (default: 2)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    launches, repeats = (4, 1) if args.quick else (8, args.repeats)
    runs = [one_run(launches) for _ in range(repeats)]
    worst = max(g for run in runs for _, g in run["gaps"])
    lines = [f"# Gaps between launches of a gated study ({'quick' if args.quick else 'full'}), "
             f"{datetime.date.today().isoformat()}", "",
             f"Machine: {machine()}. `autotune run --mem-budget {BUDGET}` on a Qwen2-style config.json (4 blocks, "
             f"hidden 256, tied embeddings), 2 ranks, seq len 128, {launches} launches, `--confirm 0`. Command: "
             f"`python benchmarks/launch_gaps.py{' --quick' if args.quick else ''}`.", ""]
    for i, run in enumerate(runs, 1):
        lines += [f"## Run {i}: {run['launches']} launches in {run['wall_s']:.0f} s; the first launch after "
                  f"{run['first_launch_s']:.1f} s; {run['fake_steps']} fake steps, {run['waited_s']:.0f} s waited for",
                  "", "| launch | gap before it | configuration |", "|---:|---:|---|"]
        lines += [f"| {n} | {gap:.2f} s | {label} |" for n, (label, gap) in enumerate(run["gaps"], 2)]
        gaps = [g for _, g in run["gaps"]]
        lines += ["", f"median gap {statistics.median(gaps):.2f} s, largest {max(gaps):.2f} s", ""]
    lines.append(f"**Largest gap over {len(runs)} run(s): {worst:.2f} s (target <= {TARGET_S:.0f} s): "
                 f"{'PASS' if worst <= TARGET_S else 'MISS'}.**")
    publish("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
