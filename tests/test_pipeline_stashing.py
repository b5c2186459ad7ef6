"""Weight stashing: the versions each stage keeps under flushless 1F1B."""

from __future__ import annotations

import pytest
from ddlab.pipeline import weight_versions


@pytest.mark.parametrize("k", [1, 2, 4, 6])
def test_pipedream_stage_s_keeps_k_minus_s_versions(k):
    assert weight_versions(k, 4 * k) == [k - s for s in range(k)]


@pytest.mark.parametrize("k", [2, 4, 6])
def test_2bw_keeps_two_versions_and_flush_one(k):
    assert weight_versions(k, 4 * k, update_every=k) == [2] * (k - 1) + [1]
    assert weight_versions(k, k, update_every=k) == [1] * k


def test_bad_update_interval_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        weight_versions(4, 8, update_every=0)
