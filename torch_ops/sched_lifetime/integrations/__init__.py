"""Integrations with other training frameworks, each importing its framework on import:
`sched_lifetime.integrations.torchtitan` (torchtitan >= 0.3.0's graph_trainer; guide:
docs/torchtitan.md)."""
