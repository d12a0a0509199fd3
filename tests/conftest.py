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

# KVATTN_TEST_SM90_DEFINES="KVATTN_SM90_KFIRST=1,KVATTN_SM90_XQK2=1": every sm90 prefill instance the tests build
# takes these compile switches (kvattn.prefill.SM90_TUNING), so the GPU files check an experiment build against the
# float64 reference before it becomes the default (scripts/ab_sm90.py times it). The run's header names them.
SM90_DEFINES = tuple((name.strip(), int(value)) for name, value in
                     (item.split("=") for item in os.environ.get("KVATTN_TEST_SM90_DEFINES", "").split(",") if item))
if SM90_DEFINES:
    from kvattn import prefill

    prefill.SM90_TUNING = SM90_DEFINES


def pytest_report_header(config):
    return f"kvattn sm90 prefill build switches: {SM90_DEFINES or 'defaults'}"
