"""Probes: the parts of the step loop that see tensors. Each has named lifecycle hooks, all called
fail-open by the loop:

    attach()            once, at set_monitor: install what stays installed (returns removable handles)
    configure(config)   at attach and at every config reload
    begin(plan)         at every step boundary: arm or disarm hooks for this step's plan
    pre_optim(plan)     collected steps: reduced gradients ready, the update not run yet
    post_optim(plan)    collected steps: the update done
    end(plan)           collected steps, after the hand-off to the worker
    close()
"""

from .activations import ActivationProbe
from .base import Probe
from .comm import CommProbe
from .gradients import GradientProbe
from .moe import MoEProbe
from .optimizer import OptimizerProbe
from .side_outputs import SideOutputsProbe
from .update import UpdateProbe

__all__ = [
    "ActivationProbe",
    "CommProbe",
    "GradientProbe",
    "MoEProbe",
    "OptimizerProbe",
    "Probe",
    "SideOutputsProbe",
    "UpdateProbe",
]
