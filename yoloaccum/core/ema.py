"""The weights' exponential moving average: Ultralytics' ModelEMA, updated once per optimizer step, with the
state_dict() that last.pt keeps of it (its weights and its count of updates, which sets the decay)."""

from __future__ import annotations

from typing import Any

from ultralytics.utils.torch_utils import ModelEMA


class EMA(ModelEMA):
    """ModelEMA as Ultralytics' trainer uses it (`.ema` the averaged model, `.updates` the count), plus state_dict()
    and load_state_dict(), as torch's own stateful objects have them."""

    def state_dict(self) -> dict[str, Any]:
        return {"weights": self.ema.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ema.load_state_dict(state["weights"])  # in place: the tensors update() pairs up stay the same
        self.updates = state["updates"]
