"""Text generation on the policy: the engine (prefix-tree prefill, decode loop, lean decoder) and
the rollout sampler / sequence scorer built on it."""
