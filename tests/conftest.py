"""Shared pytest configuration: hypothesis profiles.

"default": no deadline (first calls may compile kernels), modest example counts.
"ci": also derandomized, so a green CI run stays green; loaded when CI=true.
"thorough": many examples, for a local soak (HYPOTHESIS_PROFILE=thorough).
Tests that need more examples (GPU tests: >= 50) set them with @settings.
"""
import os

from hypothesis import settings

settings.register_profile("default", deadline=None, max_examples=40)
settings.register_profile("ci", deadline=None, max_examples=40, derandomize=True, print_blob=True)
settings.register_profile("thorough", deadline=None, max_examples=1000)
settings.load_profile("ci" if os.environ.get("CI", "").lower() == "true" else
                      os.environ.get("HYPOTHESIS_PROFILE", "default"))
