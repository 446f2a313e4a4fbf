"""An example group filter for `rollout.filter: examples.sample_filter:informative`.

A filter keeps a scored group (returns None) or drops it with a reason, counted per step as
`rollout/filter/drop_<reason>`. This one drops groups in which every response ran into the
token limit ("all truncated": the model did not finish any answer) and groups whose rewards
are all equal, as DAPO's dynamic sampling does ("no reward variance").
"""

from __future__ import annotations

from verst.rollout.dynamic import reward_variance
from verst.types import Group, Status


def informative(group: Group) -> str | None:
    if all(sample.status == Status.TRUNCATED for sample in group):
        return "all truncated"
    return reward_variance(group)
