"""``NoiseTracker``'s documented import path; the tracker lives in ``noise/_tracker.py``."""

from .noise import NoiseTracker

__all__ = ["NoiseTracker"]
