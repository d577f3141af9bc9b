"""The figure styles of ``experiments.common`` name only rules the figures draw: every rule colour has a
label and every label a colour (a colour without a label is a rule no figure shows)."""

from experiments.common import RULE_COLORS, RULE_LABELS


def test_rule_colours_and_labels_name_the_same_rules():
    assert set(RULE_COLORS) == set(RULE_LABELS) == {"rmc", "dgrs", "standard"}
