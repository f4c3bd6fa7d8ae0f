"""Four eyes on a rollback: the approver is not the requester, and an approval is required."""

from __future__ import annotations

import pytest

from sluice.airflow.operators import ApprovalRefusedError, require_second_person


def test_a_second_person_may_approve():
    require_second_person("ysb", "alice", "bob")


@pytest.mark.parametrize(("requester", "approver", "says"), [
    ("alice", "alice", "approved by 'alice', who asked for it"),
    ("alice", None, "has no recorded approval"),
    ("alice", "", "has no recorded approval"),
    (None, "bob", "does not say who triggered it"),  # no user: bob may be the requester himself
    ("", "bob", "does not say who triggered it"),
])
def test_the_requester_or_no_one_may_not(requester, approver, says):
    with pytest.raises(ApprovalRefusedError, match=says) as failure:
        require_second_person("ysb", requester, approver)
    text = str(failure.value)
    assert "pipeline 'ysb'" in text and "nothing was changed" in text.lower(), text
