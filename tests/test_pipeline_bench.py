"""bench/pipeline.py: its predictor reduces to the closed forms without message costs,
grows with them, and the script runs end to end on a tiny grid (the bubbles themselves
are measured by running it in full; see bench/results/pipeline.json)."""

import json

import pytest
from test_bench_scripts import bench, load_bench_module

pipeline_bench = load_bench_module("pipeline")


@pytest.mark.parametrize("schedule,P,M", [("gpipe", 2, 4), ("1f1b", 4, 16), ("1f1b", 8, 32),
                                          ("gpipe", 8, 4), ("interleaved:2", 2, 16),
                                          ("interleaved:2", 4, 32)])
def test_prediction_without_message_costs_is_the_closed_form(schedule, P, M):
    from mpidl.runtime import pipeline_schedule

    _, v = pipeline_schedule.parse(schedule)
    em = pipeline_bench.emulated_times(schedule, P * v, 0.02)
    pred, spans = pipeline_bench.predict(schedule, P, M, em, 0.0, 0.0, 0.0)
    assert pred["predicted"] == pytest.approx(pred["formula"], abs=1e-12)
    assert pred["simulated"] == pytest.approx(pred["formula"], abs=1e-12)
    assert len(spans) == 2 * P * M * v


def test_message_costs_raise_the_predicted_bubble_and_are_not_work():
    em = pipeline_bench.emulated_times("zb", 4, 0.02)
    base, _ = pipeline_bench.predict("zb", 4, 8, em, 0.0, 0.0, 0.0)
    costly, spans = pipeline_bench.predict("zb", 4, 8, em, 3e-4, 2e-4, 0.0)
    assert base["formula"] is None and costly["predicted"] > base["predicted"]
    assert costly["predicted_step_s"] > base["predicted_step_s"]
    # the spans drawn are the work alone: every one lasts its emulated time
    assert all(abs((e - s) - 0.02) < 1e-12 for _, _, _, _, s, e in spans)


def test_quick_run_writes_rows_criteria_timeline_and_plot(tmp_path):
    out = tmp_path / "pipeline.json"
    text = bench("pipeline.py", "--quick", "--out", out, timeout=300)
    assert "criteria hold" in text
    res = json.loads(out.read_text())
    assert {r["schedule"] for r in res["rows"]} == {"gpipe", "1f1b", "interleaved:2", "zb",
                                                    "async"}
    for r in res["rows"]:
        assert 0 < r["measured"] < 1 and 0 < r["predicted"] < 1, r
        assert len(r["measured_steps"]) == res["settings"]["steps"]
    cal = res["calibration"]["2"]
    assert cal["latency_s"] > 0 and cal["recv_s"] > 0 and cal["messages"] > 0
    assert {c["check"].split()[0] for c in res["criteria"]} == {"gpipe", "1f1b",
                                                              "interleaved:2", "zb", "async"}
    tl = res["timeline"]
    assert (tl["schedule"], tl["P"], tl["M"]) == ("1f1b", 2, 4)
    assert len(tl["measured_spans"]) == len(tl["predicted_spans"]) == 2 * 2 * 4
    assert (tmp_path / "pipeline.png").stat().st_size > 0
