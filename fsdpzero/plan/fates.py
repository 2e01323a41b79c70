"""The fate of a DeepSpeed key given its value: `decide` walks the one rule table of fsdpzero.plan.fate_table
(conditional rules first, then the key's default). translate.py calls it for every key of a config."""
from __future__ import annotations

# FATES, CONDITIONAL and RULES are imported from here too (migrate, tests)
from fsdpzero.plan.fate_table import CONDITIONAL, FATES, RULES, UNKNOWN_FATE, Rule, decide

__all__ = ["CONDITIONAL", "FATES", "RULES", "UNKNOWN_FATE", "Rule", "decide"]
