"""optuna-dashboard on a study's storage, and the study note ``autotune run`` keeps current."""

from __future__ import annotations

import optuna

from autotune.errors import UsageError
from autotune.study.record import Attr, StudyAttr, study_rate, winner
from autotune.study.verdict import Verdict, read_verdict
from autotune.units import format_bytes


def study_note(study: optuna.Study) -> str:
    """Markdown for the dashboard's study note: budget, best configuration, how to use it."""
    identity = study.user_attrs.get(StudyAttr.IDENTITY, {})
    budget = identity.get("budget_bytes")
    rate = study_rate(study)
    lines = [
        "## autotune",
        f"Model `{identity.get('model')}`, {identity.get('nproc')} ranks, seq len {identity.get('seq_len')}, "
        f"budget **{study.user_attrs.get(StudyAttr.BUDGET)}** ({format_bytes(budget) if budget else '?'}) per rank. "
        f"Objective: {rate} (maximize). Over-budget and out-of-memory trials are infeasible "
        "(constraint: peak memory - budget).",
    ]
    plan = study.user_attrs.get(StudyAttr.TRIAL_DEPTH) or {}
    if plan.get("depths"):
        lines.append(f"\nSearch trials are **extrapolated**: {rate} timed on shallow copies of "
                     f"{' and '.join(map(str, plan['depths']))} blocks and extended to the model's "
                     f"{plan.get('full_depth')} (user attribute `extrapolated`), peak memory from the full-depth "
                     "estimate; the confirmation rounds run the model at full depth.")
    best = winner(study)
    verdict = read_verdict(study)
    if best is None:
        lines.append("\nNo feasible trial yet.")
    elif verdict:
        lines += confirmation_lines(verdict, rate)
    else:
        peak = best.user_attrs.get(Attr.PEAK_MEMORY_BYTES, 0)
        how = " (extrapolated from shallow copies; peak estimated)" if best.user_attrs.get(Attr.EXTRAPOLATED) else ""
        lines += [
            f"\n**Best so far: trial {best.number}**: {best.value:,.0f} {rate}, peak {format_bytes(peak)}{how}.",
            f"\n`{best.user_attrs.get(Attr.LABEL)}`",
            "\n```json",
            *[f"{k}: {v}" for k, v in sorted(best.user_attrs.get(Attr.CONFIG, {}).items())],
            "```",
            "\nExport it: `autotune export -f accelerate|hf|torchtitan|python|json`.",
        ]
    return "\n".join(lines)


def confirmation_lines(verdict: Verdict, rate: str = "tokens/s") -> list[str]:
    """The confirmed winner, its ties and the references, as the note shows them."""
    w = verdict.winner
    lines = [f"\n**Confirmed best** ({verdict.rounds} interleaved rounds of fresh trials, tagged "
             f"`confirmation_round`): `{w.label}`: {w.mean:,.0f} {rate}, peak "
             f"{format_bytes(w.peak_memory_bytes or 0)}."]
    for tie in verdict.ties:
        lines.append(f"\n- tie: `{tie.label}`: {tie.mean:,.0f} {rate}, peak "
                     f"{format_bytes(tie.peak_memory_bytes or 0)}")
    for role, ref in verdict.references.items():
        name = role.value.replace('_', ' ')
        if ref.config == w.config:
            lines.append(f"\n- {name}: the winner is it")
        elif ref.ratio_to_winner:
            lines.append(f"\n- {name} (`{ref.label}`): the winner is {1 / ref.ratio_to_winner.mean:.2f}x it")
    lines.append("\nExport it: `autotune export -f accelerate|hf|torchtitan|python|json`.")
    return lines


def update_study_note(study: optuna.Study) -> None:
    from optuna_dashboard import save_note

    save_note(study, study_note(study))


def check_address(host: str, port: int) -> None:
    """Refuse, before the database is opened, an address this machine cannot listen on."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise UsageError(f"--host {host}: not an address of this machine ({exc}); e.g. 127.0.0.1, or 0.0.0.0 for all") \
            from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise UsageError(f"--host {host} --port {port}: cannot listen there ({exc.strerror}); choose another "
                             "--port, or a --host of this machine") from None


def serve(storage_url: str, host: str, port: int) -> None:
    """Block serving optuna-dashboard; the storage is opened as the tuner opens it."""
    from optuna_dashboard import run_server

    from autotune.study.storage import open_storage

    run_server(open_storage(storage_url), host=host, port=port)
