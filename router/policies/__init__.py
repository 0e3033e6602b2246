"""Routing policies: pure functions of (request size, per-replica load and
confirmed prefix match) that rank replicas. One file per policy; each opens
with its algorithm and every threshold with its default."""

from router.policies.adapter_affinity import AdapterAffinityPolicy
from router.policies.base import Policy, ReplicaView, RoutingInput, rank_by_load, replica_load
from router.policies.cache_aware import CacheAwarePolicy
from router.policies.least_load import LeastLoadPolicy
from router.policies.power_of_two import PowerOfTwoPolicy
from router.policies.prefix_cost import PrefixCostPolicy
from router.policies.random_choice import RandomPolicy
from router.policies.registry import DEFAULT_POLICY, POLICIES, get_policy, policy_names
from router.policies.round_robin import RoundRobinPolicy

__all__ = [
    "DEFAULT_POLICY",
    "AdapterAffinityPolicy",
    "POLICIES",
    "CacheAwarePolicy",
    "LeastLoadPolicy",
    "Policy",
    "PowerOfTwoPolicy",
    "PrefixCostPolicy",
    "RandomPolicy",
    "ReplicaView",
    "RoundRobinPolicy",
    "RoutingInput",
    "get_policy",
    "policy_names",
    "rank_by_load",
    "replica_load",
]
