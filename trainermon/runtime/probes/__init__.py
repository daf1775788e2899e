"""Probes: the parts of the step loop that see tensors. Each has named lifecycle hooks, all called
fail-open by the loop:

    attach()            once, at set_monitor: install what stays installed (returns removable handles)
    configure(config)   at attach and at every config reload
    begin(plan)         at every step boundary: arm or disarm hooks for this step's plan
    grads_final(plan)   collected steps: the reduced gradients are final, before the user's clipping scales
                        them (or at the optimizer's pre-step, just before `pre_optim`, without clipping)
    pre_optim(plan)     collected steps: reduced gradients ready, the update not run yet
    post_optim(plan)    collected steps: the update done
    end(plan)           collected steps, after the hand-off to the worker
    close()
"""

from .activations import ActivationProbe
from .attn import AttnLogitProbe
from .base import Probe
from .comm import CommProbe
from .gradients import GradientProbe
from .moe import MoEProbe
from .optimizer import OptimizerProbe
from .side_outputs import SideOutputsProbe
from .update import UpdateProbe

#: The training-health families' probes, in the order the loop runs them.
HEALTH_PROBES = (UpdateProbe, MoEProbe, AttnLogitProbe)

__all__ = [
    "HEALTH_PROBES",
    "ActivationProbe",
    "AttnLogitProbe",
    "CommProbe",
    "GradientProbe",
    "MoEProbe",
    "OptimizerProbe",
    "Probe",
    "SideOutputsProbe",
    "UpdateProbe",
]
