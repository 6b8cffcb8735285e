"""Token-length distributions of a workload, parsed from short specs ("256", "uniform:128:512", ...).

Used by `phaselab bench` (text prompts of these lengths), `phaselab simulate` (token counts) and
`phaselab compare --simulate`; the same spec and seed give the same draws everywhere.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np


class WorkloadError(ValueError):
    """A workload cannot be built as asked (bad length spec, prompt shorter than the template, ...)."""


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution, parsed from a short spec (every draw is >= 1):

        "256"                  always 256
        "uniform:128:512"      integers uniform in [128, 512]   (vLLM --random-range-ratio r on L:
                                                                 uniform:L*(1-r):L*(1+r))
        "normal:256:64"        mean 256, std 64, rounded
        "lognormal:256:0.5"    median 256, sigma 0.5 of the log (long tail, like chat traffic)
        "choice:128,256,1024"  one of the listed lengths, equally likely
    """

    kind: str
    params: tuple[float, ...]

    @classmethod
    def parse(cls, spec: str | int) -> LengthDist:
        text = str(spec).strip()
        if re.fullmatch(r"\d+", text):
            return cls("fixed", (float(text),))
        kind, _, rest = text.partition(":")
        try:
            if kind == "choice":
                values = tuple(float(v) for v in rest.split(","))
                if not values:
                    raise ValueError
                return cls(kind, values)
            params = tuple(float(v) for v in rest.split(":"))
        except ValueError:
            params = ()
        arity = {"uniform": 2, "normal": 2, "lognormal": 2}
        if kind not in arity or len(params) != arity[kind]:
            raise WorkloadError(
                f"length spec {spec!r}: use N, uniform:LO:HI, normal:MEAN:STD, lognormal:MEDIAN:SIGMA "
                "or choice:A,B,C"
            )
        if kind == "uniform" and params[0] > params[1]:
            raise WorkloadError(f"length spec {spec!r}: LO must be <= HI")
        return cls(kind, params)

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        p = self.params
        if self.kind == "fixed":
            draws = np.full(n, p[0])
        elif self.kind == "uniform":
            draws = rng.integers(int(p[0]), int(p[1]), size=n, endpoint=True)
        elif self.kind == "normal":
            draws = np.rint(rng.normal(p[0], p[1], size=n))
        elif self.kind == "lognormal":
            draws = np.rint(rng.lognormal(math.log(p[0]), p[1], size=n))
        else:
            draws = rng.choice(np.asarray(p), size=n)
        return [max(1, int(v)) for v in draws]

    def mean(self) -> float:
        p = self.params
        return {
            "fixed": lambda: p[0], "uniform": lambda: (p[0] + p[1]) / 2, "normal": lambda: p[0],
            "lognormal": lambda: p[0] * math.exp(p[1] ** 2 / 2), "choice": lambda: sum(p) / len(p),
        }[self.kind]()

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.params[0]))
        sep = "," if self.kind == "choice" else ":"
        return self.kind + ":" + sep.join(f"{v:g}" for v in self.params)


