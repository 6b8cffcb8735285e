"""The executor interface: what the engine loop drives, whatever runs the plan.

The torch `ModelRunner` is one implementation; the simulator's cost model and the remote
workers of disaggregated serving are others. The engine loop does not know which one it has.
"""

from __future__ import annotations

from typing import Protocol

from phaselab.core.outputs import SchedulerOutput, StepResult


class Executor(Protocol):
    def execute(self, plan: SchedulerOutput) -> StepResult: ...
