"""Enums shared by the configuration and the components it configures.

A leaf module: it imports nothing of kvtier, so ``kvtier.config`` and the tiers can both
import it without importing each other.
"""

from __future__ import annotations

import enum


class Switch(enum.Enum):
    """An optional acceleration: force it on, force it off, or use it where it works."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"
