"""Memory estimator, cost model, strategy planner and scale simulator.

Library entry points (the ``meshyard plan`` command only parses arguments and calls them)::

    describe_gpt(shape) / describe_config(model_cfg, vocab, seq) / describe_module(module, seq)
        -> ModelDescription
    estimate_memory(desc, layout) -> MemoryEstimate
    estimate_step(desc, layout, cluster) -> StepEstimate
    plan(desc, cluster, request) -> PlanResult
    simulate_scale(desc, cluster, sizes, request) -> ScaleResult
"""

from meshyard.plan.cost import StepEstimate, estimate_step
from meshyard.plan.hardware import Cluster, make_cluster
from meshyard.plan.layout import PRECISIONS, PlannedLayout, make_layout
from meshyard.plan.memory import MemoryEstimate, estimate_memory
from meshyard.plan.model import ModelDescription, describe_gpt
from meshyard.plan.scale import ScaleResult, simulate_scale
from meshyard.plan.search import PlanRequest, PlanResult, plan
from meshyard.plan.trace import describe_config, describe_module

__all__ = [
    "PRECISIONS", "Cluster", "PlannedLayout", "MemoryEstimate", "ModelDescription", "PlanRequest", "PlanResult",
    "ScaleResult", "StepEstimate", "describe_config", "describe_gpt", "describe_module", "estimate_memory",
    "estimate_step", "make_cluster", "make_layout", "plan", "simulate_scale",
]
