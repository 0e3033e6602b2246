"""Policy registry: a policy by name, with its thresholds as keyword params.

    policy = get_policy("cache_aware", balance_abs_threshold=4)
    ranked_ids = policy.choose(RoutingInput(num_blocks, num_prompt_tokens, views))

Each call builds a fresh instance (no shared state between deployments).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from router.policies.adapter_affinity import AdapterAffinityPolicy
from router.policies.base import Policy
from router.policies.cache_aware import CacheAwarePolicy
from router.policies.least_load import LeastLoadPolicy
from router.policies.power_of_two import PowerOfTwoPolicy
from router.policies.prefix_cost import PrefixCostPolicy
from router.policies.random_choice import RandomPolicy
from router.policies.round_robin import RoundRobinPolicy

DEFAULT_POLICY = "prefix_cost"

POLICIES: dict[str, Callable[..., Policy]] = {
    "cache_aware": CacheAwarePolicy,
    "least_load": LeastLoadPolicy,
    "power_of_two": PowerOfTwoPolicy,
    "prefix_cost": PrefixCostPolicy,
    "round_robin": RoundRobinPolicy,
}

# Baselines of ``prefixserve simulate``: get_policy builds them, but they are not
# deployable policies (policy_names() and the cluster config leave them out).
BASELINE_POLICIES: dict[str, Callable[..., Policy]] = {
    "adapter_affinity": AdapterAffinityPolicy,
    "random": RandomPolicy,
}


def policy_names() -> list[str]:
    """Returns the registered policy names, the default first."""
    return [DEFAULT_POLICY] + sorted(n for n in POLICIES if n != DEFAULT_POLICY)


def get_policy(name: str = DEFAULT_POLICY, **params: Any) -> Policy:
    """Builds the policy called ``name``.

    Args:
        name: One of ``policy_names()`` or ``BASELINE_POLICIES``.
        **params: The policy's constructor parameters (its thresholds).

    Returns:
        A new policy instance.

    Raises:
        ValueError: Unknown name, unknown parameter, or a bad parameter value;
            the message lists what is accepted.
    """
    factory = POLICIES.get(name) or BASELINE_POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown routing policy {name!r}; choose one of: {', '.join(policy_names())} "
                         f"(benchmark baselines: {', '.join(sorted(BASELINE_POLICIES))})")
    signature = inspect.signature(factory)
    try:
        signature.bind(**params)
    except TypeError:
        accepted = ", ".join(signature.parameters) or "none"
        raise ValueError(f"routing policy {name!r} got parameters {sorted(params)}; it accepts: {accepted}") from None
    return factory(**params)
