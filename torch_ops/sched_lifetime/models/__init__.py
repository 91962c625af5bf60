"""The embedded models the main job and the benches train."""

from .moe import CONFIGS, MoEConfig, MoEModel

__all__ = ["CONFIGS", "MoEConfig", "MoEModel"]
