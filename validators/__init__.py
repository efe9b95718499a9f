"""Recipe schema, V4 contract rules and derived figures. Pure Python + pydantic: never imports torch.

Library entry point for other commands::

    from v4launch.validators import validate_recipe
    report = validate_recipe(load_recipe("recipes/flash_4n.yaml"))
    report.ok, report.violations, report.warnings, report.stages, report.to_dict()
"""

from .report import Report, RuleResult, StageResult, Violation, validate_recipe
from .rules import RULES, Rule

__all__ = ["RULES", "Report", "Rule", "RuleResult", "StageResult", "Violation", "validate_recipe"]
