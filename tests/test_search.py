"""autotune's search and confirmation round, through the seams (scripted launches, in-memory storage)."""

import dataclasses
import json
import math
import random

import optuna
import pytest

from autotune.config import FsdpConfig
from autotune.study import run_study
from autotune.study.record import Attr, StudyAttr, is_confirmation, is_feasible, trial_config
from autotune.study.verdict import Role, read_verdict
from autotune.study.margin import ESTIMATE_SLACK
from autotune.study.frontier import frontier_configs
from tests.test_objective import HOST, LAYER, MODEL, MiB, ScriptedEstimator, ScriptedLaunch, ok, settings

SPACE = ("fsdp_version: [1, 2]\nsharding_strategy: [FULL_SHARD, SHARD_GRAD_OP, NO_SHARD]\nmixed_precision: [fp32, "
         "bf16]\nactivation_checkpointing: [none, full]\nmicro_batch_size: [1, 2, 4]\n")


def speed(cfg: FsdpConfig) -> float:
    """A smooth landscape like a CPU table's: bf16, bigger batches and less recompute win."""
    value = 1000.0 * (2.0 if cfg.mixed_precision == "bf16" else 1.0) * (1 + 0.3 * math.log2(cfg.micro_batch_size))
    value *= 0.8 if cfg.activation_checkpointing == "full" else 1.0
    value *= {"NO_SHARD": 1.05, "SHARD_GRAD_OP": 1.0, "FULL_SHARD": 0.9}[cfg.sharding_strategy]
    return value * (1.02 if cfg.fsdp_version == 2 else 1.0)


def peak(cfg: FsdpConfig) -> int:
    """Memory like a real one: batch and no checkpointing cost most, sharding and bf16 save."""
    base = {"NO_SHARD": 60, "SHARD_GRAD_OP": 45, "FULL_SHARD": 35}[cfg.sharding_strategy]
    activations = 12 * cfg.micro_batch_size * (0.4 if cfg.activation_checkpointing == "full" else 1.0)
    return int((base + activations) * (0.7 if cfg.mixed_precision == "bf16" else 1.0) * MiB)


@pytest.fixture(autouse=True)
def private_locks(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_LOCK_DIR", str(tmp_path / "locks"))


def search(tmp_path, budget_mib: int, trials: int, noise: float = 0.0, seed: int = 0, storage=None, space=SPACE,
           **changes):
    rng = random.Random(seed)

    def answer(cfg, request):
        tokens = speed(cfg) * (1 + rng.gauss(0, noise))
        return ok(tokens=tokens, peak=peak(cfg))

    launch = ScriptedLaunch(answer)
    estimator = ScriptedEstimator(peak)
    run = run_study(settings(tmp_path, space, budget=budget_mib * MiB, trials=trials, seed=seed, **changes), HOST,
                    MODEL,
                    launch=launch, estimator=estimator, storage=storage or optuna.storages.InMemoryStorage())
    return run, launch


def test_no_configuration_is_drawn_or_launched_twice_under_a_tight_budget(tmp_path):
    run, launch = search(tmp_path, budget_mib=50, trials=80)
    keys = [c.key() for c in launch.launched]
    assert len(keys) == len(set(keys)), "a configuration was launched twice"
    drawn = [trial_config(t).key() for t in run.study.trials if trial_config(t) and not is_confirmation(t)]
    assert len(drawn) == len(set(drawn)), "a configuration was drawn twice"
    # Only what may fit is launched: predicted within budget, or over it by less than the estimate's slack.
    assert all(peak(c) * (1 - ESTIMATE_SLACK["exact"]) <= 50 * MiB for c in launch.launched[1:]), \
        "a configuration predicted over budget even at the estimate's low side was launched"
    near = [t for t in run.study.trials if trial_config(t) and peak(trial_config(t)) > 50 * MiB
            and not is_confirmation(t)
            and Attr.WALL_S in t.user_attrs]
    assert near and all(0 < t.user_attrs[Attr.FIT_CHANCE] < 1 for t in near)
    # Measured over the budget, they are infeasible like any other: the launch told.
    assert not any(is_feasible(t) for t in near)
    # Everything that fits was measured, and the run says that is why it stopped.
    fitting = [c for c in settings(tmp_path, SPACE).study.space.enumerate(LAYER) if peak(c) <= 50 * MiB]
    assert run.stop_reason == "space exhausted"
    assert {c.key() for c in fitting} <= set(keys)
    excluded = run.study.user_attrs[StudyAttr.EXCLUDED]
    assert excluded["count"] > 0 and all(e["reason"] for e in excluded["examples"])


def test_the_run_stops_when_its_launches_are_done(tmp_path):
    run, launch = search(tmp_path, budget_mib=500, trials=6)
    assert len(launch.launched) == 6 and run.stop_reason == "launches"


def test_the_first_launches_are_the_standard_recipe_then_the_memory_frontier(tmp_path):
    run, launch = search(tmp_path, budget_mib=70, trials=6)
    recipe, *frontier = launch.launched[:5]
    assert run.study.trials[0].user_attrs[Attr.BASELINE]
    # The standard recipe: FSDP2 FULL_SHARD, layer wrap, bf16 (fast here), full checkpointing, the largest micro batch that fits.
    assert (recipe.fsdp_version, recipe.sharding_strategy, recipe.mixed_precision, recipe.activation_checkpointing,
            recipe.micro_batch_size) == (2, "FULL_SHARD", "bf16", "full", 4)
    # Then the least communicating strategy, spanning checkpointing x micro batch (none and full in this space),
    # then every other strategy once, each at the largest micro batch that fits.
    assert [(c.sharding_strategy, c.activation_checkpointing) for c in frontier] == [
        ("NO_SHARD", "none"), ("NO_SHARD", "full"), ("SHARD_GRAD_OP", "none"), ("FULL_SHARD", "none")]
    for cfg in frontier:
        assert cfg.mixed_precision == "bf16" and cfg.fsdp_version == 2 and peak(cfg) <= 70 * MiB
        bigger = cfg.replace(micro_batch_size=cfg.micro_batch_size * 2)
        assert cfg.micro_batch_size == 4 or peak(bigger) > 70 * MiB


def test_frontier_falls_back_to_checkpointing_only_when_nothing_fits_without():
    candidates = [FsdpConfig(sharding_strategy="FULL_SHARD", mixed_precision="bf16", activation_checkpointing=ac,
                             micro_batch_size=m, transformer_layer_cls=LAYER) for ac in ("none", "full") for m in (1,
                                                                                                                   2)]
    seeds = frontier_configs(candidates, lambda c: c.activation_checkpointing == "full" and c.micro_batch_size == 1,
                             ("bf16",))
    assert [(c.activation_checkpointing, c.micro_batch_size) for c in seeds] == [("full", 1)]
    assert frontier_configs(candidates, lambda c: False, ("bf16",)) == []


def test_the_frontier_is_planned_a_strategy_at_a_time_and_a_strategy_that_cannot_fit_costs_one_question():
    """Each question is a fake step (seconds): the next launch waits only for the strategy it is about to take.
    80 s passed between the first two launches of a gated Qwen2 study when the whole frontier was planned at once,
    a fake step per checkpointing mode and precision of strategies that could not fit at all."""
    from autotune.study.frontier import frontier_by_strategy

    candidates = [FsdpConfig(sharding_strategy=s, mixed_precision=p, activation_checkpointing=ac, micro_batch_size=m,
                             transformer_layer_cls=LAYER)
                  for s in ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD") for p in ("bf16", "fp32")
                  for ac in ("none", "selective", "full") for m in (1, 2, 4)]
    asked = []

    def fits(cfg):
        asked.append(cfg)
        return cfg.sharding_strategy != "NO_SHARD" and (cfg.micro_batch_size <= 2
                                                        or cfg.activation_checkpointing == "full")

    plan = frontier_by_strategy(candidates, fits, ("bf16", "fp32"))
    first = next(plan)
    assert {c.sharding_strategy for c in first} == {"SHARD_GRAD_OP"}
    # NO_SHARD: its least hungry configuration alone (full checkpointing, micro batch 1, bf16).
    no_shard = [c for c in asked if c.sharding_strategy == "NO_SHARD"]
    assert [(c.activation_checkpointing, c.micro_batch_size, c.mixed_precision) for c in no_shard] == [("full", 1,
                                                                                                        "bf16")]
    assert not any(c.sharding_strategy == "FULL_SHARD" for c in asked), "the next strategy was planned before its turn"
    assert [c.sharding_strategy for c in next(plan)] == ["FULL_SHARD"] and next(plan, None) is None


def test_the_search_finds_the_best_within_a_few_launches(tmp_path):
    budget = 60
    best = max((c for c in settings(tmp_path, SPACE).study.space.enumerate(LAYER) if peak(c) <= budget * MiB),
               key=speed)
    run, launch = search(tmp_path, budget_mib=budget, trials=8)
    found = max((c for c in launch.launched if peak(c) <= budget * MiB), key=speed)
    assert speed(found) >= 0.97 * speed(best), (found.describe(), best.describe())


def test_confirmation_names_the_winner_its_ties_and_the_references(tmp_path):
    run, launch = search(tmp_path, budget_mib=500, trials=8, noise=0.02, confirm=3)
    verdict = run.verdict
    # Stored as a dict, read back as the same types.
    assert verdict is not None and verdict == read_verdict(run.study)
    assert verdict.rounds == 3 and len(verdict.winner.values) == 3
    confirmations = [t for t in run.study.trials if is_confirmation(t)]
    roles = {t.user_attrs[Attr.CONFIRMATION_ROLE] for t in confirmations}
    assert {Role.FINALIST, Role.PYTORCH_DEFAULTS} <= roles
    # The standard recipe (the study's first trial) runs as a reference unless it is a finalist already.
    finalist_configs = [e.config for e in [verdict.winner, *verdict.ties, *verdict.others] if e.role == Role.FINALIST]
    recipe = next(trial_config(t) for t in run.study.trials if t.user_attrs.get(Attr.BASELINE))
    assert (Role.STANDARD_RECIPE in roles) != (recipe.to_dict() in finalist_configs)
    # Interleaved: every round holds every entry before the next round starts.
    rounds = [t.user_attrs[Attr.CONFIRMATION_ROUND] for t in sorted(confirmations, key=lambda t: t.number)]
    assert rounds == sorted(rounds)
    assert verdict.references[Role.PYTORCH_DEFAULTS].ratio_to_winner.mean < 0.7  # fp32, no wrap: far slower
    lo, hi = verdict.winner.ci95
    assert lo <= verdict.winner.mean <= hi
    for tie in verdict.ties:
        assert tie.ratio_to_winner.ci95[1] is None or tie.ratio_to_winner.ci95[1] >= 1.0


def test_a_resumed_study_does_not_redo_finished_rounds(tmp_path):
    storage = optuna.storages.InMemoryStorage()
    small = "fsdp_version: 2\nsharding_strategy: [FULL_SHARD, SHARD_GRAD_OP]\nmixed_precision: bf16\nmicro_batch_size: [1, 2]\n"
    first, _ = search(tmp_path, budget_mib=500, trials=10, noise=0.02, confirm=2, storage=storage, space=small)
    assert first.stop_reason == "space exhausted" and first.verdict.rounds == 2
    again, launch = search(tmp_path, budget_mib=500, trials=10, noise=0.02, confirm=2, storage=storage, space=small)
    assert launch.launched == [], "a finished confirmation round ran again"
    assert again.verdict.winner.label == first.verdict.winner.label


def test_confirm_0_skips_the_round(tmp_path):
    run, _ = search(tmp_path, budget_mib=500, trials=5, confirm=0)
    assert run.verdict is None and not any(is_confirmation(t) for t in run.study.trials)


def test_a_search_sampler_of_optuna_still_runs(tmp_path):
    for sampler in ("tpe", "gp", "random"):
        run, launch = search(tmp_path / sampler, budget_mib=60, trials=4, search=sampler)
        assert len(launch.launched) == 4, sampler


def test_the_prior_follows_what_the_probe_measured_of_each_precision():
    import dataclasses

    from autotune.config.dimensions import precision_effects

    amx = dataclasses.replace(HOST, bf16_speedup=7.3, fp16_speedup=0.06)  # this VM: bf16 fast, fp16 20x slow
    effects = precision_effects(amx)
    assert effects["bf16"] > effects["fp32"] > effects["fp16"]
    plain = dataclasses.replace(HOST, bf16_speedup=0.1, fp16_speedup=0.1)
    assert precision_effects(plain)["fp32"] > precision_effects(plain)["bf16"]
    h100 = dataclasses.replace(HOST, device_type="cuda", cuda_device_count=8, cuda_capability=(9, 0))
    assert h100.fp16_is_fast and precision_effects(h100)["fp16"] > precision_effects(h100)["fp32"]
    v100 = dataclasses.replace(h100, cuda_capability=(7, 0))
    assert v100.fp16_is_fast and not v100.bf16_is_fast
    assert max(precision_effects(v100), key=precision_effects(v100).get) == "fp16"


def test_fp16_on_a_host_that_runs_it_slowly_is_not_where_the_search_starts(tmp_path):
    import dataclasses

    from autotune.study.priors import host_priors
    from autotune.study.search import ModelSearch

    space = settings(tmp_path, "mixed_precision: [fp32, bf16, fp16]\nsharding_strategy: [FULL_SHARD, NO_SHARD]\n"
                               "micro_batch_size: [1, 2]\n").study.space
    host = dataclasses.replace(HOST, bf16_speedup=7.3, fp16_speedup=0.06)
    search = ModelSearch(space.enumerate(LAYER), LAYER, lambda cfg: (1.0, None), host_priors(host, 32))
    assert [c.mixed_precision for c in search.frontier()] == ["bf16", "bf16"]
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    assert search.propose(study).mixed_precision == "bf16"


def test_a_finalist_that_is_a_reference_serves_as_it_and_runs_once(tmp_path, capsys):
    from autotune.outputs.summary import summarize

    # The standard recipe (FSDP2 FULL_SHARD, layer wrap, bf16, full checkpointing, largest micro batch) is the fastest here.
    small = ("fsdp_version: 2\nsharding_strategy: FULL_SHARD\nmixed_precision: [bf16, fp32]\n"
             "activation_checkpointing: full\nmicro_batch_size: [1, 2]\n")
    run, _ = search(tmp_path, budget_mib=500, trials=10, noise=0.0, confirm=2, space=small)
    verdict = run.verdict
    assert verdict.winner.config["mixed_precision"] == "bf16" and verdict.winner.micro_batch_size == 2
    assert verdict.references[Role.STANDARD_RECIPE].config == verdict.winner.config
    roles = [t.user_attrs[Attr.CONFIRMATION_ROLE] for t in run.study.trials if is_confirmation(t)]
    assert Role.STANDARD_RECIPE not in roles, "the standard recipe ran twice in a round"
    # The summary reads the verdict back from storage (copies, not the same objects).
    assert summarize(run, settings(tmp_path, small, budget=500 * MiB, confirm=2)) == 0
    out = capsys.readouterr().out
    assert "The winner is the standard recipe" in out and "winner (= standard_recipe)" in out


def test_the_frontier_spans_checkpointing_and_micro_batch_and_the_probe_orders_it(tmp_path):
    """On a GPU, where one 2048-token sample leaves the device half idle, the standard recipe's
    neighbourhood (checkpointing at the largest micro batch that fits) comes first; on a CPU
    saturated by a few hundred tokens, no recompute comes first."""
    import dataclasses

    from autotune.study.priors import host_priors
    from autotune.study.search import ModelSearch

    space = settings(tmp_path, "fsdp_version: 2\nsharding_strategy: [FULL_SHARD, NO_SHARD]\nmixed_precision: "
                               "bf16\nactivation_checkpointing: [none, selective, full]\nmicro_batch_size: [1, 2, 4, "
                               "8]\n").study.space
    candidates = space.enumerate(LAYER)

    def fits(c):  # no checkpointing fits 1, selective 2, full 8 samples (NO_SHARD one size less)
        limit = {"none": 1, "selective": 2, "full": 8}[c.activation_checkpointing]
        return (1.0, None) if c.micro_batch_size * (2 if c.sharding_strategy == "NO_SHARD" else 1) <= limit else (0.0,
                                                                                                                  "no")

    gpu = dataclasses.replace(HOST, device_type="cuda", cuda_device_count=1, cuda_capability=(9, 0),
                              saturation={2048: 0.45, 4096: 0.7, 8192: 0.9, 16384: 1.0})
    cpu = dataclasses.replace(HOST, saturation={256: 1.0, 2048: 1.0, 16384: 0.98})
    order = {}
    for name, host in (("gpu", gpu), ("cpu", cpu)):
        frontier = ModelSearch(candidates, LAYER, fits, host_priors(host, 2048)).frontier()
        order[name] = [(c.sharding_strategy, c.activation_checkpointing, c.micro_batch_size) for c in frontier]
    # The least communicating strategy that fits spans the checkpointing modes at the largest micro batch each
    # fits (none fits nowhere here), then each other strategy once, at what the probe expects fastest.
    assert order["gpu"] == [("NO_SHARD", "full", 4), ("NO_SHARD", "selective", 1), ("FULL_SHARD", "full", 8)]
    assert order["cpu"] == [("NO_SHARD", "selective", 1), ("NO_SHARD", "full", 4), ("FULL_SHARD", "none", 1)]


def test_a_recipe_outside_the_space_is_measured_beside_the_answer_and_never_exported(tmp_path, capsys):
    """The space of issue 37: FSDP2 FULL_SHARD, bf16, no checkpointing, micro batch 2, one trial. The standard recipe
    (full checkpointing) lies outside it: it runs as a reference, not as the one trial, and where it is faster the
    summary names the choice the space leaves out; the answer, and its export, stay inside the space."""
    from autotune.outputs.summary import best_config_path, summarize
    from autotune.study.record import winner

    space = ("fsdp_version: 2\nsharding_strategy: FULL_SHARD\nmixed_precision: bf16\nactivation_checkpointing: none\n"
             "micro_batch_size: 2\n")
    launch = ScriptedLaunch(lambda cfg, req: ok(tokens=1200.0 if cfg.activation_checkpointing == "full" else 1000.0,
                                                peak=peak(cfg)))
    storage_url = f"sqlite:///{tmp_path}/s.db"
    asked = settings(tmp_path, space, budget=500 * MiB, trials=1)
    asked = dataclasses.replace(asked, study=dataclasses.replace(asked.study, storage_url=storage_url))
    run = run_study(asked, HOST, MODEL, launch=launch, estimator=ScriptedEstimator(peak))
    assert [c.activation_checkpointing for c in launch.launched] == ["full", "none"]
    assert (run.counts.launched, run.counts.references) == (1, 1)
    reference = run.study.trials[0]
    assert reference.user_attrs[Attr.BASELINE] and reference.user_attrs[Attr.OUTSIDE_SPACE]
    assert trial_config(winner(run.study)).activation_checkpointing == "none"
    capsys.readouterr()
    assert summarize(run, asked) == 0
    out = capsys.readouterr().out
    assert "The standard recipe, which the space does not offer, ran 1.20x the answer" in out
    assert "leaves out activation_checkpointing=full" in out and "1 reference outside the space" in out
    exported = json.loads(best_config_path(storage_url, run.study.study_name).read_text())
    assert exported["fsdp"]["activation_checkpointing"] == "none"


def test_a_recipe_the_space_offers_is_one_of_its_trials(tmp_path):
    run, launch = search(tmp_path, budget_mib=500, trials=3)
    assert not run.study.trials[0].user_attrs.get(Attr.OUTSIDE_SPACE)
    assert run.counts.references == 0 and len(launch.launched) == 3
