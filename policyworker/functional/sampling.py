"""Sampling: the generation settings logprobs are computed under, as one record.

Logprobs of a policy must match what the inference engine sampled from: logits divided by the
temperature, then (when set) restricted by top-k and top-p. The worker holds one `Sampling`
built from `generation`; the reference model and the KL term use `unfiltered()` (temperature
kept, filters off).
"""

from typing import Any

import attrs

from policyworker.functional.logprobs import sampling_filters_active

__all__ = ["Sampling"]


@attrs.frozen(kw_only=True)
class Sampling:
    """Temperature, top-k (None, 0 or -1: off) and top-p (1.0: off) of generation."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0

    @classmethod
    def of_generation(cls, generation: Any) -> "Sampling":
        """The settings of a `GenerationConfig` (None: plain softmax at temperature 1)."""
        if generation is None:
            return cls()
        return cls(
            temperature=generation.temperature, top_k=generation.top_k, top_p=generation.top_p
        )

    @property
    def filters_active(self) -> bool:
        """Whether top-k or top-p remove any token (filtered-out tokens get -inf logprobs)."""
        return sampling_filters_active(self.top_k, self.top_p)

    def unfiltered(self) -> "Sampling":
        """The same temperature with top-k and top-p off."""
        return Sampling(temperature=self.temperature)

    def as_kwargs(self) -> dict[str, Any]:
        """``temperature=, top_k=, top_p=`` for the scoring functions that take them apart."""
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}
