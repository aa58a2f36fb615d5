"""doccp: exact, balanced context-parallel attention over packed variable-length documents."""

from doccp.layout import DocLayout
from doccp.masks import Mask
from doccp.plan import Plan, PlanStats, plan

__version__ = "0.1.0"

__all__ = ["DocLayout", "Mask", "Plan", "PlanStats", "plan", "__version__"]
