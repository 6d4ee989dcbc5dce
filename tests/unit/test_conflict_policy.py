"""The two-way conflict policies as users write them (add-peer --conflict, add-table --conflict)."""

from __future__ import annotations

import pytest

from pgcascade.core.errors import UserError
from pgcascade.replica.conflicts import ConflictPolicy, PolicyKind


@pytest.mark.parametrize(
    ("text", "kind", "arg"),
    [
        ("last-update-wins", PolicyKind.LAST_UPDATE_WINS, None),
        ("first-update-wins", PolicyKind.FIRST_UPDATE_WINS, None),
        ("origin-wins:paris", PolicyKind.ORIGIN_WINS, "paris"),
        ("keep-local", PolicyKind.KEEP_LOCAL, None),
        ("apply-remote", PolicyKind.APPLY_REMOTE, None),
        ("error", PolicyKind.ERROR, None),
        ("function:app.pick_newer", PolicyKind.FUNCTION, "app.pick_newer"),
    ],
)
def test_policies_parse_and_print_back(text: str, kind: PolicyKind, arg: str | None) -> None:
    p = ConflictPolicy.parse(text)
    assert (p.kind, p.arg) == (kind, arg)
    assert str(p) == text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("newest-wins", "unknown conflict policy 'newest-wins'"),
        ("origin-wins", "needs a name"),
        ("keep-local:a", "takes no argument"),
        ("function:drop table x", "give a function name"),
    ],
)
def test_bad_policies_are_refused_in_one_line(text: str, message: str) -> None:
    with pytest.raises(UserError, match=message) as e:
        ConflictPolicy.parse(text)
    assert "\n" not in str(e.value)
