"""Anomaly rules, first-anomaly localisation across ranks, the spike rule, and escalation."""

from __future__ import annotations

import json
import logging
import math
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed import run_ranks
from tests.helpers import read_family, write_config
from trainermon import ConfigError, TrainerMon, parse_config
from trainermon.cli import main as cli_main
from trainermon.collect.records import RowMeta, StatBatch
from trainermon.pipeline.anomaly import AnomalyDetector, load_anomalies
from trainermon.pipeline.rule_specs import parse_rules


def _batch(step: int, rows: list[tuple[str, str]], **columns: list[float]) -> StatBatch:
    metas = [RowMeta(family, 0, name, None, (4,), torch.float32, 4) for family, name in rows]
    return StatBatch(step, metas, {k: np.array(v, dtype=np.float64) for k, v in columns.items()})


def test_msprobe_rules_with_their_faults_fixed(tmp_path):
    rules = parse_rules(
        [
            {"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}},
            {"rule_name": "AnomalyNan", "args": {"threshold": 100.0}},
        ]
    )
    det = AnomalyDetector(rules, str(tmp_path), rank=3)
    rows = [("grad_reduced", "a"), ("grad_reduced", "b")]
    det.check(_batch(0, rows, norm=[1.0, 2.0], mean=[1.0, -1.0], nans=[0, 0], infs=[0, 0]))
    det.check(_batch(1, rows, norm=[1.2, 2.0], mean=[1.1, -1.0], nans=[0, 0], infs=[0, 0]))
    assert det.counts == {}
    # Step 2: tensor a has norm and mean both turbulent (two records, not one overwriting the other);
    # tensor b has 500 NaNs (a count: never compared with the magnitude threshold 100) and an Inf.
    det.check(_batch(2, rows, norm=[5.0, 2.0], mean=[9.0, -1.0], nans=[0, 500], infs=[0, 1]))
    det.check(_batch(3, rows, norm=[1.0, 250.0], mean=[1.0, -1.0], nans=[0, 0], infs=[0, 0]))
    det.close()
    recs = load_anomalies(str(tmp_path))
    got = {(r["step"], r["name"], r["stat"], r["rule"]) for r in recs}
    assert got == {
        (2, "a", "norm", "AnomalyTurbulence"),
        (2, "a", "mean", "AnomalyTurbulence"),
        (2, "b", "nans", "AnomalyNan"),
        (2, "b", "infs", "AnomalyNan"),
        (3, "b", "norm", "AnomalyNan"),  # above the magnitude threshold
        (3, "b", "norm", "AnomalyTurbulence"),
    }
    assert all(r["rank"] == 3 for r in recs)
    assert det.counts["AnomalyNan"] == 3


def test_non_finite_statistics_without_counts_are_caught(tmp_path):
    det = AnomalyDetector(parse_rules([{"rule_name": "AnomalyNan"}]), str(tmp_path), rank=0)
    det.check(_batch(0, [("actv", "x"), ("actv", "y")], norm=[math.inf, 1.0], max=[math.nan, 1.0]))
    det.close()
    assert {(r["name"], r["stat"]) for r in load_anomalies(str(tmp_path))} == {("x", "norm"), ("x", "max")}


def test_the_more_anomalies_line_names_the_rank(tmp_path, caplog):
    """Past the per-step limit the log's summary line names the rank (4 ranks' logs interleave)."""
    det = AnomalyDetector(parse_rules([{"rule_name": "AnomalyNan"}]), str(tmp_path), rank=5, dump=False)
    rows = [("actv", n) for n in "abcde"]
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        det.check(_batch(7, rows, nans=[1, 1, 1, 1, 1]))
    det.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4 and all(line.endswith("on rank 5") for line in lines), lines
    assert "and 2 more anomalies at step 7 on rank 5" in lines[3]


def test_bad_rule_config_names_the_key():
    with pytest.raises(ConfigError, match=r"alert.rules\[0\].rule_name"):
        parse_config({"alert": {"rules": [{"rule_name": "AnomalyMagic"}]}})
    with pytest.raises(ConfigError, match=r"alert.rules\[0\].args.threshold"):
        parse_config({"alert": {"rules": [{"rule_name": "AnomalyNan", "args": {"threshold": "big"}}]}})
    with pytest.raises(ConfigError, match="alert.escalate_steps"):
        parse_config({"alert": {"rules": [], "escalate_steps": -1}})


def test_a_rule_name_not_a_string_and_an_unknown_argument_name_key_and_value(tmp_path, capsys):
    """A list as rule_name once raised TypeError (unhashable), and check-config printed a traceback, rc 1."""
    with pytest.raises(ConfigError) as exc:
        parse_config({"alert": {"rules": [{"rule_name": ["AnomalyNan"]}]}})
    said = str(exc.value)
    assert "config key 'alert.rules[0].rule_name': got ['AnomalyNan']; allowed: one of" in said, said
    assert "'AnomalyNan'" in said.split("allowed:")[1], said
    with pytest.raises(ConfigError) as exc:
        parse_config({"alert": {"rules": [{"rule_name": "AnomalyNan", "args": {"foo": 3}}]}})
    said = str(exc.value)
    assert "config key 'alert.rules[0].args.foo': got 3; AnomalyNan takes no such argument" in said, said
    assert "allowed: ['threshold']" in said, said
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"alert": {"rules": [{"rule_name": {"n": 1}}]}}))
    assert cli_main(["check-config", str(cfg)]) == 2
    assert "invalid: config key 'alert.rules[0].rule_name': got {'n': 1}" in capsys.readouterr().err


def _rule(name: str, **args) -> dict:
    return {"rules": [{"rule_name": name, "args": args}]}


RULE0 = r"alert.rules\[0\]"


@pytest.mark.parametrize(
    "alert, key, allowed",
    [
        ({"rule": []}, "alert.rule", "'rules', 'dump', 'escalate_steps'"),  # a misspelt section key
        ({"rules": [], "escalate_step": 3}, "alert.escalate_step", "'escalate_steps'"),
        ({"rules": [{"rule_name": "AnomalySpike", "arg": {"z": 3}}]}, RULE0 + ".arg", "'args'"),
        (_rule("AnomalySpike", zz=3), RULE0 + ".args.zz", "'z'"),
        (_rule("AnomalyNan", window=3), RULE0 + ".args.window", "'threshold'"),
        (_rule("AnomalySpike", window=5), RULE0 + ".args.window", r"warmup \(10\)"),
        (_rule("AnomalySpike", window=0), RULE0 + ".args.window", "never fires"),
        (_rule("AnomalyUpdateRatio", warmup=60), RULE0 + ".args.window", r"\(60\)"),
        (_rule("AnomalySpike", warmup=2.5), RULE0 + ".args.warmup", "whole number"),
        # an anomaly audit: z 0 fired on every value above the median (32 records on a healthy run), and a
        # warmup of 0 or 1 ran as 2 without a word
        (_rule("AnomalySpike", z=0), RULE0 + ".args.z", "positive number"),
        (_rule("AnomalyUpdateRatio", warmup=1), RULE0 + ".args.warmup", "at least 2"),
    ],
)
def test_unknown_alert_keys_and_a_window_that_never_fills_are_refused(alert, key, allowed):
    """Each of these once left a rule off or on its defaults without a word."""
    with pytest.raises(ConfigError, match=rf"config key '{key}'.*allowed: .*{allowed}"):
        parse_config({"alert": alert})


def test_every_rule_argument_is_accepted():
    from trainermon.pipeline.rule_specs import RULE_ARGS

    for name, args in RULE_ARGS.items():
        # every argument at 20, a value each takes (`dead`, a fraction of the experts, below 1)
        rules = [{"rule_name": name, "args": {a: 0.5 if a == "dead" else 20 for a in args}}]
        assert parse_config(
            {"alert": {"rules": rules, "dump": True, "escalate_steps": 2}}
        ).alert.rules == tuple(rules)


def _steady_run(tmp_path, monkeypatch, steps: int, spike_step: int, **alert):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(
        tmp_path / "cfg.json",
        wg_distribution=True,
        ops=["norm", "mean"],
        alert={
            "rules": [{"rule_name": "AnomalySpike", "args": {"warmup": 5, "z": 6}}],
            "dump": True,
            **alert,
        },
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 8, generator=gen)
    for step in range(steps):
        scale = 1000.0 if step == spike_step else 1.0
        (model(x + 0.01 * torch.randn(32, 8, generator=gen)).pow(2).mean() * scale).backward()
        opt.step()
        opt.zero_grad()
        if step == spike_step:
            monitor.flush()  # the detector has seen the spike before the next step begins
    monitor.close()
    return monitor


def test_spike_fires_at_the_spike_and_not_before(tmp_path, monkeypatch):
    monitor = _steady_run(tmp_path, monkeypatch, steps=25, spike_step=15)
    recs = load_anomalies(str(tmp_path / "out"))
    spikes = [r for r in recs if r["rule"] == "AnomalySpike"]
    assert {r["step"] for r in spikes} == {15}  # no false positive in 15 warm, steady steps, none after
    assert any(r["name"] == "global_grad_norm" for r in spikes)
    glob_spike = next(r for r in spikes if r["name"] == "global_grad_norm")
    assert glob_spike["value"] > 100 * glob_spike["baseline"]
    assert monitor.loop.detector.counts["AnomalySpike"] == len(spikes)
    # The cumulative count rides on every step's derived values, which the Prometheus sink exports.
    assert monitor.last_batch.derived.anomalies_total["AnomalySpike"] == len(spikes)


def test_escalation_collects_activations_for_exactly_k_steps(tmp_path, monkeypatch):
    run_dir = _steady_run(tmp_path, monkeypatch, steps=25, spike_step=12, escalate_steps=3).run_dir
    actv = read_family(str(run_dir), "actv")
    # The spike is evaluated on the worker; escalation starts at the next step boundary after that.
    assert sorted({int(r["step"]) for r in actv}) == [14, 15, 16]
    assert {r["name"] for r in actv} == {"0.input", "0.output", "1.input", "1.output", "2.input", "2.output"}
    assert {int(r["step"]) for r in read_family(str(run_dir), "actv_grad")} == {14, 15, 16}


# ---- first-anomaly localisation on 2 ranks ----------------------------------------------------------
NAN_STEP, NAN_RANK = 3, 1


def _nan_run(rank: int, world: int, root: str) -> int:
    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(root, "out")
    cfg = os.path.join(root, f"cfg{rank}.json")
    with open(cfg, "w") as fh:
        json.dump(
            {
                "xy_distribution": True,
                "all_xy": True,
                "wg_distribution": True,
                "ops": ["norm", "max", "nans"],
                "alert": {"rules": [{"rule_name": "AnomalyNan"}], "dump": True},
            },
            fh,
        )
    torch.manual_seed(0)
    model = nn.Sequential(
        OrderedDict(
            fc1=nn.Linear(6, 16), act1=nn.Tanh(), fc2=nn.Linear(16, 16), act2=nn.Tanh(), head=nn.Linear(16, 1)
        )
    )
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(ddp, optimizer=opt)
    gen = torch.Generator().manual_seed(rank)
    for step in range(6):
        if step == NAN_STEP and rank == NAN_RANK:
            with torch.no_grad():
                model.fc2.weight[3, 5] = float("nan")  # a bad weight on one rank only
        ddp(torch.randn(4, 6, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    monitor.close()
    return monitor.faults.total


def test_first_anomaly_names_layer_rank_and_step(tmp_path, capsys):
    assert run_ranks(_nan_run, world_size=2, root=str(tmp_path)) == [0, 0]
    out = str(tmp_path / "out")
    assert sorted(os.listdir(os.path.join(out, "anomaly_detected"))) == [
        "anomaly_rank0.jsonl",
        "anomaly_rank1.jsonl",
    ]
    assert cli_main(["anomalies", out, "--top", "5"]) == 0
    printed = capsys.readouterr().out
    first = json.loads(open(os.path.join(out, "anomaly_analysis.json")).read())[0]
    assert (first["step"], first["rank"], first["name"], first["family"]) == (
        NAN_STEP,
        NAN_RANK,
        "fc2.output",
        "actv",
    )
    assert first["stage"] == "forward" and first["stat"] == "nans"
    assert "fc2.output" in printed.splitlines()[2]  # the table's first row
    # Nothing went wrong before the injection, on either rank.
    assert min(r["step"] for r in load_anomalies(out)) == NAN_STEP
    written = (Path(out) / "anomaly_analysis.json").read_text()
    assert cli_main(["anomalies", out, "--steps", "0-2"]) == 0
    # ... and leaves the analysis written before in place (it was replaced by [])
    assert (Path(out) / "anomaly_analysis.json").read_text() == written
    total = len(load_anomalies(out))
    runs = sorted({r["run_id"] for r in load_anomalies(out)})
    # a filter that leaves nothing says so, and what lies outside it (a typo is no "nothing recorded")
    said = capsys.readouterr().out
    assert f"in steps 0-2 ({total} outside that filter; runs: {', '.join(runs)})" in said, said
    assert cli_main(["anomalies", out, "--run-id", "nosuch"]) == 2
    assert f"--run-id 'nosuch': not in {out!r} (its run ids: {runs})" in capsys.readouterr().err
    assert cli_main(["anomalies", out, "--run-id", runs[0], "--steps", "0-2"]) == 0  # there, not in 0-2
    assert f"for run {runs[0]!r} in steps 0-2 ({total} outside" in capsys.readouterr().out
    assert cli_main(["anomalies", out, "--json", str(tmp_path / "no" / "such.json")]) == 2
    err = capsys.readouterr().err
    assert "--json" in err and "cannot write" in err, err


@pytest.mark.parametrize(
    "argv, said",
    [
        (["anomalies", "DIR", "--steps", "20-10"], "--steps '20-10': allowed: N or FIRST-LAST, non-negative"),
        (["anomalies", "DIR", "--top", "-1"], "--top: got -1; allowed: a whole number >= 0"),
        (["anomalies", "DIR", "--steps", "5-"], "--steps '5-': allowed: N or FIRST-LAST"),  # once step 5
        (["compare", "DIR", "DIR", "--max-plots", "-1"], "--max-plots: got -1; allowed: a whole number >= 0"),
        (["analyze", "DIR", "--steps", "5-1"], "FIRST <= LAST"),
        (["compare", "DIR", "DIR", "--steps", "3-2"], "FIRST <= LAST"),
        (["analyze", "DIR", "--top", "0"], "--top: got 0; allowed: a whole number >= 1"),
        (["convert", "DIR", "OUT", "--rows-per-part", "0"], "--rows-per-part: got 0"),
    ],
)
def test_cli_refuses_reversed_steps_and_negative_counts(tmp_path, capsys, argv, said):
    """A reversed range once printed "no anomalies" and --top -1 all records but one: both rc 0."""
    argv = [str(tmp_path) if a == "DIR" else str(tmp_path / "o") if a == "OUT" else a for a in argv]
    try:
        rc = cli_main(argv)
    except SystemExit as exc:  # argparse's refusals
        rc = exc.code
    assert rc == 2 and said in capsys.readouterr().err


def test_dump_false_detects_and_counts_but_writes_no_record_file(tmp_path):
    """msprobe's `alert.dump`: records are written to anomaly_detected/ only when it is true."""
    rules = parse_rules([{"rule_name": "AnomalyNan"}])
    det = AnomalyDetector(rules, str(tmp_path), rank=0, dump=False)
    found = det.check(_batch(0, [("grad_reduced", "w")], norm=[math.nan], nans=[2], infs=[0]))
    det.close()
    assert [a.rule for a in found] == ["AnomalyNan"] and det.totals() == {"AnomalyNan": 1}
    assert not (tmp_path / "anomaly_detected").exists()


def _nan_at(out: str, nan_step: int, layer: int) -> str:
    """One run into `out`: a NaN gradient in `model[layer]` at `nan_step`; returns the run id."""
    cfg = write_config(
        Path(out).parent / f"c{nan_step}.json",
        wg_distribution=True,
        ops=["norm", "nans"],
        alert={"rules": [{"rule_name": "AnomalyNan"}], "dump": True},
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    for step in range(nan_step + 1):
        model(torch.randn(3, 4)).square().sum().backward()
        if step == nan_step:
            model[layer].weight.grad[0, 0] = math.nan
        opt.step()
        opt.zero_grad()
    monitor.close()
    return monitor.loop.outputs.run_id


def test_runs_sharing_an_output_directory_keep_their_anomalies_apart(tmp_path, monkeypatch, capsys):
    """A job restarted into the same MONITOR_OUTPUT_DIR appends to the same record file: the records say
    which run they belong to, a run's analysis counts its own only, and the listing goes run by run (the
    second run's step 2 once came before the first run's step 5, as if it had happened first)."""
    from trainermon.analysis.analyze import analyze

    out = str(tmp_path / "out")
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", out)
    first = _nan_at(out, nan_step=5, layer=1)
    second = _nan_at(out, nan_step=2, layer=0)
    assert first != second
    records = load_anomalies(out)
    # per run: the weight before and after the reduce, and the global norm (NaN, as clip_grad_norm_'s)
    assert [(r["run_id"], r["step"]) for r in records] == [(first, 5)] * 3 + [(second, 2)] * 3
    names = [r["name"] for r in records]
    assert names == ["1.weight"] * 2 + ["global_grad_norm"] + ["0.weight"] * 2 + ["global_grad_norm"]
    assert [r["step"] for r in load_anomalies(out, run_ids={second})] == [2, 2, 2]
    for run, step in ((first, 5), (second, 2)):
        (run_dir,) = [d for d in os.listdir(out) if d.endswith(f"-rank0-{run}")]
        found = analyze(os.path.join(out, run_dir), progress=False).anomalies
        assert {(r["run_id"], r["step"]) for r in found} == {(run, step)}, run
    assert cli_main(["anomalies", out, "--run-id", second]) == 0
    printed = capsys.readouterr().out
    assert "3 anomalies" in printed and "1.weight" not in printed
    assert cli_main(["anomalies", out]) == 0
    assert f"2 runs, in the order they wrote: {first}, {second}" in capsys.readouterr().out


def test_a_reloaded_window_applies_to_the_existing_histories(tmp_path):
    """A reload (or a restored state) that shortens AnomalySpike's window: the histories kept their old
    length, so a level shift down was judged against the old level for 50 more steps."""
    spike = {"rule_name": "AnomalySpike", "args": {"window": 50, "warmup": 2}}
    det = AnomalyDetector(parse_rules([spike]), str(tmp_path), rank=0)
    step = 0
    for value in [10.0] * 40:
        assert det.check(_batch(step, [("grad_reduced", "w")], norm=[value])) == []
        step += 1
    det.rules = parse_rules([{**spike, "args": {"window": 10, "warmup": 2}}])  # what loop._reload does
    for value in [1.0] * 12:  # the new level (lower: not spikes, they enter the baseline)
        assert det.check(_batch(step, [("grad_reduced", "w")], norm=[value])) == []
        step += 1
    found = det.check(_batch(step, [("grad_reduced", "w")], norm=[8.0]))
    det.close()
    assert [(a.rule, a.name, a.baseline) for a in found] == [("AnomalySpike", "w", pytest.approx(1.0))]


def test_two_rules_of_one_name_keep_their_own_histories(tmp_path):
    """msprobe accepts a rule twice (two thresholds); each must compare against the earlier values only
    (the second once saw an average that already held the new value, each value added twice)."""
    rules = [
        {"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}},
        {"rule_name": "AnomalyTurbulence", "args": {"threshold": 2.0}},
    ]
    det = AnomalyDetector(parse_rules(rules), str(tmp_path), rank=0)
    for step in range(5):
        assert det.check(_batch(step, [("grad_reduced", "w")], norm=[1.0])) == []
    found = det.check(_batch(5, [("grad_reduced", "w")], norm=[3.5]))
    det.close()
    # 3.5 is above 1.5 and above 3.0: both rules fire, each against the average 1.0
    assert [(a.rule, a.stat, a.baseline) for a in found] == [("AnomalyTurbulence", "norm", 1.0)] * 2
    assert det.totals() == {"AnomalyTurbulence": 2}


def test_the_listing_keeps_its_columns_for_long_rule_names(tmp_path, capsys):
    """`AnomalyExpertCollapse` (21 characters) overflowed the rule column and shifted the rest of its row."""
    folder = tmp_path / "anomaly_detected"
    folder.mkdir()
    base = {"micro_step": None, "stage": "optimizer", "call_order": 0, "rank": 0, "pp_stage": 0, "value": 2.0}
    rows = [
        {**base, "step": 1, "rule": "AnomalyNan", "family": "grad_reduced", "stat": "norm", "name": "a.w"},
        {**base, "step": 2, "rule": "AnomalyExpertCollapse", "family": "moe_load", "stat": "cv", "name": "b"},
    ]
    common = {"baseline": None, "time": 0.0, "run_id": "r1"}
    (folder / "anomaly_rank0.jsonl").write_text("".join(json.dumps({**r, **common}) + "\n" for r in rows))
    assert cli_main(["anomalies", str(tmp_path), "--json", str(tmp_path / "a.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if "family" in line)
    listed = [line for line in lines if line.rstrip().endswith((" a.w", " b"))]
    assert len(listed) == 2
    starts = {line.index(fam) for line, fam in zip(listed, ("grad_reduced", "moe_load"))}
    assert starts == {header.index("family")}, (header, listed)


def test_check_config_says_what_set_monitor_would_say_without_a_model(tmp_path, capsys):
    """An anomaly audit: `check-config` printed "ok" alone for alert settings that can never act, which
    set_monitor then warns about (escalate_steps without rules, a rule whose family is off)."""
    cfg = tmp_path / "c.json"
    alert = {"rules": [{"rule_name": "AnomalyUpdateRatio"}]}
    cfg.write_text(json.dumps({"wg_distribution": True, "alert": alert}))
    assert cli_main(["check-config", str(cfg)]) == 0
    printed = capsys.readouterr().out
    assert "note: alert.rules[0] AnomalyUpdateRatio can never fire" in printed, printed
    cfg.write_text(json.dumps({"wg_distribution": True, "alert": {"rules": [], "escalate_steps": 3}}))
    assert cli_main(["check-config", str(cfg)]) == 0
    assert "note: alert.escalate_steps 3 has no effect" in capsys.readouterr().out
    cfg.write_text(json.dumps({"wg_distribution": True, "module_ranks": [7], "dynamic_on": True}))
    assert cli_main(["check-config", str(cfg)]) == 0
    assert "note:" not in capsys.readouterr().out  # the launch's world size and environment: not judged
