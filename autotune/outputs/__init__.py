"""What a study's readers make of it: the trials table, the run summary, exports, the report, the dashboard.

Readers import the trial record (:mod:`autotune.study.record`), never the
orchestrator.
"""
