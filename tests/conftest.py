"""Shared fixtures of the front-end tests (capture, passes, costs, condensation, inspect).

Cost annotation needs a :class:`~fxsplit.ir.DeviceSpec`. Tests that check numbers use the fixed
``ref_device`` (round peaks, so expected times are exact); tests that only need *a* device use
``cpu_spec``, measured once per session so ``measure_cpu_spec`` is not re-run by every test.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from fxsplit.ir import DeviceSpec

# Hypothesis profiles (issue 10): "ci" (the default) keeps each test's own example count and
# draws the same examples every run (derandomized: a red CI is reproducible, a green one is not
# luck); "soak" draws fresh examples, 1000 for tests that do not set a count (the transparency
# property scales with FXSPLIT_TRANSPARENCY_CASES, and bench/soak.py runs it by the thousand).
# Choose with HYPOTHESIS_PROFILE=soak.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("soak", derandomize=False, deadline=None, max_examples=1000, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

REF_PEAK_FLOPS = 1e12
REF_BANDWIDTH = 1e11


@pytest.fixture(scope="session")
def ref_device() -> DeviceSpec:
    """A fixed device: 1 TFLOP/s, 100 GB/s, so roofline times are exact and deterministic."""
    return DeviceSpec("ref", peak_flops=REF_PEAK_FLOPS, memory_bandwidth_bytes_per_s=REF_BANDWIDTH)


@pytest.fixture(scope="session")
def cpu_spec() -> DeviceSpec:
    """This CPU, measured once per test session."""
    from fxsplit.passes.costs import measure_cpu_spec

    return measure_cpu_spec(size=256)


@pytest.fixture(scope="session", autouse=True)
def _profile_cache_in_a_temporary_folder(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The profiled cost model (compile's default) caches timings under ``$XDG_CACHE_HOME``:
    tests share one fresh cache folder per session instead of the user's."""
    import os

    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
