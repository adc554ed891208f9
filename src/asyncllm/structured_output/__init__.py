"""Structured output (torch, runner side): the constrained requests' grammars, compiled beside the core,
their matchers (in the step thread or the grammar process), jump-forward, and each step's token bitmask filled
on the host. Two seams, both plain data: the sampler gets a `TokenMask` (`sample/sampler.py`) and reads
`SamplingState.constrained`, and sample/ never imports this package; the core gets forced tokens and refusals
in `step.ModelRunnerOutput` (`forced`, `failed`). Knows nothing of scheduling, models or how tokens are drawn."""
