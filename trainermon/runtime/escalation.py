"""Escalation: after an anomaly outside the activations, collect every module's activations for
`alert.escalate_steps` steps. The anomaly is found on the worker thread; it only leaves a request here,
which the step loop applies at its next step boundary (so every hook of a step sees one decision)."""

from __future__ import annotations

import collections


class Escalation:
    def __init__(self) -> None:
        self._requests: collections.deque[int] = collections.deque()  # appends/pops are atomic
        self.until = -1  # last step of the current escalation
        # A resumed run: requests saved with the state wait past the resumed step, whose plan the saved
        # run had made before they came (uninterrupted, they apply at the boundary after it)
        self._held_through = -1

    def request(self, steps: int) -> None:
        """Worker thread: escalate for `steps` steps from the next step boundary on."""
        if steps > 0:
            self._requests.append(steps)

    def active_at(self, step: int) -> bool:
        """Step boundary (training thread): apply waiting requests; True while `step` is escalated."""
        while self._requests and step > self._held_through:
            self.until = max(self.until, step + self._requests.popleft() - 1)
        return step <= self.until

    def clear(self) -> None:
        """A new config from the watched file: an escalation of the old one (running or queued) ends."""
        self._requests.clear()
        self.until = -1

    def state_dict(self) -> dict:
        # Requests the worker left since the last boundary: the resumed run applies them where this one
        # would have, at the boundary after the saved step
        return {"until": self.until, "pending": list(self._requests)}

    def load_state_dict(self, state: dict, step: int) -> None:
        """`state` as checked by `resume_state.check_state`, saved at `step` (the resumed step)."""
        self.until, self._held_through = int(state.get("until", -1)), step
        self._requests.clear()
        self._requests.extend(int(n) for n in state.get("pending", ()))
