"""The group stage's report pieces: scaling table + plot, bytes-held table (kmesh.report, from a summary dict)."""
from __future__ import annotations

from kmesh.report import plots, tables


def _row(n: int, serial: float, batched: float) -> dict:
    return {"children": n, "pairs": 2, "serial_ms": serial * n, "layer_major_ms": serial * n, "batched_ms": batched * n,
            "serial_ms_per_child": serial, "layer_major_ms_per_child": serial, "batched_ms_per_child": batched,
            "ratio_layer_major_over_serial": 1.0, "ratio_batched_over_serial": batched / serial,
            "speedup_batched": serial / batched, "layer_major_faster_pairs": 1, "batched_faster_pairs": 2,
            "spread": {a: {"iqr_over_median": 0.1 * n} for a in ("serial", "layer_major", "batched")},
            "peak_memory": {a: {"bytes": 2**20 * n, "what": "host process peak RSS above baseline"}
                            for a in ("serial", "layer_major", "batched")}}


def test_scaling_table_plot_and_bytes_held(tmp_path):
    scaling = {"1": _row(1, 10.0, 11.0), "4": _row(4, 10.0, 5.0),
               "goal_batched_2x_at_4": {"goal": 2.0, "measured_speedup": 2.0, "met": True}}
    df = tables.scaling_frame(scaling)
    assert list(df["children"]) == [1, 4] and df["speedup batched"].iloc[1] == 2.0
    assert df["peak batched [MiB]"].iloc[1] == 4.0
    assert df["serial IQR/median"].iloc[1] == 0.4    # the baseline's spread beside its ratios
    assert "host process peak RSS" in tables.scaling_caption("group", scaling)
    written = tables.write_table(df, tmp_path / "group_scaling", ["md", "csv"])
    assert "children" in written[0].read_text() and written[1].read_text().startswith("children,")
    png = plots.scaling_plot(scaling, tmp_path / "group_scaling", ["png"], "t")
    assert png[0].stat().st_size > 1000
    held = {"by_group_size": {"1": {"store_bytes_per_child": 8.0, "repaired_copy_bytes_per_child": 8.0,
                                    "held_per_child_full_copies": 16.0, "diff_bytes_per_child": 2.0,
                                    "held_per_child_with_diffs": 10.0, "diff_saving_fraction": 0.75,
                                    "compression_full_over_diff": 4.0}}}
    bh = tables.bytes_held_frame(held)
    assert bh["full/diff"].iloc[0] == 4.0 and bh["children"].iloc[0] == 1


def test_the_rag_group_cases_cannot_be_configured_away():
    """group.rag is required: a config without it is refused, so its cases never vanish from a green stage."""
    import pytest

    from kmesh.config import load_config, validate
    from kmesh.errors import ConfigError

    cfg = load_config(profile="cpu")
    schema = cfg.root / "config" / "config.schema.yaml"
    validate(cfg.data, schema)
    without = {**cfg.data, "group": {k: v for k, v in cfg.section("group").items() if k != "rag"}}
    with pytest.raises(ConfigError, match="rag"):
        validate(without, schema)
