"""Contract rules: one small registered function per rule (see ``base.py`` for the protocol).

Importing this package registers every rule in ``RULES`` (id → ``Rule``); the import order
below is the order rules appear in reports.
"""

# isort: off
from . import world, attention, model_build, context_parallel, precision, pipeline, schedule, phases, released, unimplemented, cuda_graph, memory, storage, slurm, time_budget  # noqa: F401  (registration)
# isort: on
from . import trackers  # noqa: F401, E402  (registration; reported after the others)
from .base import RULES, Checked, Context, Finding, NotApplicable, Rule, rule

__all__ = ["RULES", "Checked", "Context", "Finding", "NotApplicable", "Rule", "rule"]
