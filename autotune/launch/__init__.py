"""Launching trials (standard library only, no torch, no optuna).

``launcher`` runs one trial as one torchrun job and classifies how it ended;
``forkserver`` forks trial processes from a pre-imported interpreter;
``locks`` holds device slots and critical sections across the tuners of a
host; ``devices`` names a slot's physical devices; ``process_life`` ties a
process's life to its parent's; ``host`` asks the probe what the host and the
model are; ``estimator_client`` runs the fake-step memory estimates.
"""
