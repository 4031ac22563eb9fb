"""`digenrl bench bubbles` on a 150-column terminal (issue 37): every scenario and schedule name and every header
whole, the table within the width."""

from __future__ import annotations

from typer.testing import CliRunner

from digenrl_cli.main import app

# The longest names (those rich cut first); the full default set takes 25 s here.
SCENARIOS = ("hunyuan-16", "qwenedit-32", "flux-mixflash-32", "hetero-sd3-nft")


def test_every_name_and_header_is_whole_at_150_columns() -> None:
    # The longest schedule name beside colocated (the speedup's baseline); two batches: the table is the point.
    args = [a for name in SCENARIOS for a in ("--scenario", name)]
    res = CliRunner().invoke(app, ["bench", "bubbles", *args, "--batches", "2", "--no-decomposition", "--schedule",
                                   "colocated", "--schedule", "verl-omni-async-lend"], env={"COLUMNS": "150"})
    assert res.exit_code == 0, res.output
    table = res.output[:res.output.index("└")]
    assert "…" not in table
    assert all(len(line) <= 150 for line in table.splitlines())
    for name in (*SCENARIOS, "verl-omni-async-lend", "scenario", "schedule", "samples/s"):
        assert f"┃ {name} " in table or f"│ {name} " in table, name
