"""From a validated job and cluster to torchrun running on every node: plan, Ray, agents."""
