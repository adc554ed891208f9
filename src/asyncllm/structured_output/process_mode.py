"""`GrammarProcessMode`: where constrained requests' matchers live (ASYNCLLM_GRAMMAR_PROCESS, settled for one
runner from the variable's choice, the device and the ranks). Plain data; the runner's `GrammarTable` acts on it.
"""

from __future__ import annotations

import enum

import torch

from asyncllm.envs import GrammarProcessChoice


class GrammarProcessMode(enum.Enum):
    """Where constrained requests' matchers live (ASYNCLLM_GRAMMAR_PROCESS, settled for this runner)."""

    OFF = "off"  # the step thread (the twin)
    LAZY = "lazy"  # a process started in the background at the first constrained request
    EAGER = "eager"  # a process started with the engine

    @classmethod
    def of(cls, chosen: GrammarProcessChoice, device: torch.device, ranks: int = 1) -> GrammarProcessMode:
        """auto: the process on CUDA with one rank, where its draws wait on the device for their masks (with
        several ranks its draws would wait on the host, which measured slower than the step thread)."""
        if chosen is GrammarProcessChoice.AUTO:
            return cls.LAZY if device.type == "cuda" and ranks == 1 else cls.OFF
        return cls.EAGER if chosen is GrammarProcessChoice.ON else cls.OFF
