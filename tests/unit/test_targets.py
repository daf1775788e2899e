"""Targets: a tied parameter is selected by any of its names (a GPT-2-like model whose `lm_head.weight` is
`wte.weight`, built here), and a target or family that selects nothing gets one warning naming it and the
closest existing names."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from tests.helpers import assert_row_matches, keyed, read_family, ref_stats, write_config

OPS = ("norm", "mean", "min", "max")


class TinyTiedLM(nn.Module):
    """Embedding, one block, final norm and an output head tied to the embedding, as GPT-2 ties them."""

    def __init__(self, vocab: int = 11, dim: int = 8) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.block = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: named_parameters() lists it once, as wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids)
        return self.lm_head(self.ln_f(h + self.block(h)))


def _train(tmp_path, **cfg_keys):
    from trainermon import TrainerMon

    cfg = write_config(tmp_path / "cfg.json", ops=list(OPS), ndigits=12, **cfg_keys)
    torch.manual_seed(0)
    model = TinyTiedLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    refs: dict = {}
    gen = torch.Generator().manual_seed(2)
    for step in range(2):
        ids = torch.randint(0, 11, (3, 5), generator=gen)
        nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
        refs[step] = ref_stats(model.wte.weight.grad)  # the tied weight's gradient: both uses summed
        opt.step()
        opt.zero_grad()
    monitor.close()
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    return monitor, refs


@pytest.mark.parametrize("target", ["lm_head", "lm_head.weight", "wte"])
def test_tied_parameter_selected_by_either_name(tmp_path, out_dir, static_mode, caplog, target):
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        monitor, refs = _train(tmp_path, targets={target: {}}, wg_distribution=True)
    rows = keyed(read_family(monitor.run_dir, "grad_reduced"))
    assert set(rows) == {("wte.weight", 0, None), ("wte.weight", 1, None)}  # once, under its first name
    for (_, step, _), row in rows.items():
        assert_row_matches(row, refs[step], OPS)
    assert not [r for r in caplog.records if "select" in r.getMessage()], [
        r.getMessage() for r in caplog.records
    ]


def test_module_registered_under_two_names(tmp_path, out_dir, static_mode):
    """A module reachable under two names is selected by either, and written under its first name."""
    from trainermon import TrainerMon

    model = TinyTiedLM()
    model.head_alias = model.lm_head  # registered twice; named_modules() lists it once, as lm_head
    monitor = TrainerMon(
        write_config(tmp_path / "cfg.json", targets={"head_alias": {}}, xy_distribution=True)
    )
    monitor.set_monitor(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.randint(0, 11, (2, 3))).sum().backward()
    monitor.loop.adapter.optimizer.step()
    monitor.close()
    assert {n for (n, _, _) in keyed(read_family(monitor.run_dir, "actv"))} == {
        "lm_head.input",
        "lm_head.output",
    }


def _warnings(caplog) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "select" in r.getMessage()
    ]


def test_unknown_target_warns_once_with_closest_names(tmp_path, out_dir, static_mode, caplog):
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        monitor, _ = _train(
            tmp_path, targets={"lm_haed": {}, "block.0": {}}, wg_distribution=True, xy_distribution=True
        )
    lines = _warnings(caplog)
    assert len(lines) == 1, lines
    assert "'lm_haed' selects nothing" in lines[0] and "'lm_head'" in lines[0], lines
    assert {n for (n, _, _) in keyed(read_family(monitor.run_dir, "grad_reduced"))} == {
        "block.0.weight",
        "block.0.bias",
    }


def test_parameter_name_target_with_activations_warns(tmp_path, out_dir, static_mode, caplog):
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        _train(tmp_path, targets={"block.0.weight": {}}, wg_distribution=True, xy_distribution=True)
    lines = _warnings(caplog)
    assert len(lines) == 2, lines  # the target has no module; the actv family has nothing at all
    assert "'block.0.weight' names parameters but no module" in lines[0] and "'block.0'" in lines[0]
    assert "actv/actv_grad: the targets ['block.0.weight'] select no module" in lines[1]


def test_family_with_nothing_warns(tmp_path, out_dir, static_mode, caplog):
    """A target naming a module without parameters, with gradients on: the gradient families are empty."""
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        monitor, _ = _train(tmp_path, targets={"block.1": {}}, wg_distribution=True, xy_distribution=True)
    lines = _warnings(caplog)
    assert len(lines) == 1 and "select no parameter" in lines[0] and "wte.weight" in lines[0], lines
    assert read_family(monitor.run_dir, "actv")  # the module's activations are collected


def test_all_targets_valid_no_warning(tmp_path, out_dir, static_mode, caplog):
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        _train(
            tmp_path,
            targets={"block.0": {}, "ln_f": {}},
            wg_distribution=True,
            xy_distribution=True,
            mv_distribution=False,
        )
    assert not _warnings(caplog)


def _train_sequential(tmp_path, layers: int, targets: dict) -> set[str]:
    """A plain nn.Sequential of Linear layers, gradients on: the names of its grad_reduced rows."""
    from trainermon import TrainerMon

    tmp_path.mkdir()
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(layers)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(write_config(tmp_path / "cfg.json", targets=targets, wg_distribution=True))
    monitor.set_monitor(model, optimizer=opt)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    monitor.close()
    return {n for (n, _, _) in keyed(read_family(monitor.run_dir, "grad_reduced"))}


def test_vpp_form_only_for_a_target_with_a_colon(tmp_path, out_dir, static_mode, caplog):
    """Target "0" is module 0 of an nn.Sequential, not every parameter of vpp stage 0 (msprobe's `0:...`
    form matched it); "0:2" is stage 0's module 2."""
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        assert _train_sequential(tmp_path / "a", 3, {"0": {}}) == {"0.weight", "0.bias"}
        assert _train_sequential(tmp_path / "b", 3, {"0:2": {}}) == {"2.weight", "2.bias"}
    assert not _warnings(caplog)


def test_empty_target_is_refused(tmp_path):
    from trainermon import TrainerMon
    from trainermon.config import ConfigError

    with pytest.raises(ConfigError, match=r"config key 'targets': got .*names without the empty one"):
        TrainerMon(write_config(tmp_path / "cfg.json", targets={"": {}, "x": {}}, wg_distribution=True))


def _rule(name: str, **args) -> dict:
    return {"rule_name": name, "args": args}


def _attach_warnings(tmp_path, caplog, **cfg_keys) -> list[str]:
    """The trainermon warnings of `set_monitor` on a tiny model, and the run's output files."""
    from trainermon import TrainerMon

    model = nn.Sequential(nn.Linear(4, 4))
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        monitor = TrainerMon(write_config(tmp_path / "cfg.json", **cfg_keys))
        monitor.set_monitor(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        monitor.close()
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize(
    "keys, said",
    [
        ({}, "switches on no family, so nothing is collected"),
        ({"ops": ["norm"], "forward_only": True}, "forward_only has no effect"),
        ({"wg_distribution": True, "backward_only": True}, "backward_only has no effect"),
        ({"mv_distribution": True, "monitor_mbs_grad": True}, "monitor_mbs_grad has no effect"),
        (
            {"xy_distribution": True, "module_ranks": [5]},
            "module_ranks [5]: no such rank in this job of 1, so no",
        ),
        (
            {"xy_distribution": True, "module_ranks": [0, 3]},
            "module_ranks [3]: no such rank in this job of 1",
        ),
        ({"wg_distribution": True, "dynamic_on": True}, "DYNAMIC_MONITOR is not 'true'"),
        (
            {"wg_distribution": True, "alert": {"rules": [_rule("AnomalyUpdateRatio", threshold=1)]}},
            "alert.rules[0] AnomalyUpdateRatio can never fire: it reads the update rows, and "
            "update_distribution is off",
        ),
        (
            {
                "wg_distribution": True,
                "alert": {"rules": [_rule("AnomalyNan"), _rule("AnomalyExpertCollapse")]},
            },
            "alert.rules[1] AnomalyExpertCollapse can never fire: it reads the moe_load rows, and "
            "moe_distribution is off",
        ),
        (
            {"wg_distribution": True, "alert": {"rules": [_rule("AnomalyLogitGrowth")]}},
            "AnomalyLogitGrowth can never fire: it reads the attn_logit rows, and "
            "attn_logit_distribution.enable is off",
        ),
        (
            {"wg_distribution": True, "prometheus": {"port": 9400}},
            "the prometheus section has no effect: format ['csv'] does not include 'prometheus'",
        ),
        (
            {"wg_distribution": True, "format": "csv", "parquet": {"steps_per_part": 4}},
            "the parquet section has no effect: format ['csv'] does not include 'parquet'",
        ),
        (
            {"wg_distribution": True, "format": ["csv", "prometheus"], "prometheus": {"families": ["actv"]}},
            "prometheus.families ['actv'] selects no family the config switches on",
        ),
        (
            {"wg_distribution": True, "alert": {"escalate_steps": 5}},
            "alert.escalate_steps 5 has no effect: no alert rule is configured",
        ),
    ],
)
def test_switches_that_select_nothing_say_so(tmp_path, out_dir, static_mode, caplog, keys, said):
    """Each of these configs was accepted with no word while it collected nothing (or ignored a key)."""
    lines = _attach_warnings(tmp_path, caplog, **keys)
    assert [line for line in lines if said in line], lines


def test_switches_that_select_something_say_nothing(tmp_path, out_dir, static_mode, caplog):
    keys = {"xy_distribution": True, "forward_only": True, "module_ranks": [0], "wg_distribution": True}
    alert = {"rules": [_rule("AnomalyUpdateRatio", threshold=1), _rule("AnomalyNan")], "escalate_steps": 2}
    assert not _attach_warnings(
        tmp_path,
        caplog,
        monitor_mbs_grad=True,
        update_distribution=True,
        alert=alert,
        format=["csv", "parquet"],
        parquet={"steps_per_part": 4},
        **keys,
    )


@pytest.mark.parametrize(
    "keys",
    [
        {"wg_distribution": True, "prometheus": {"families": ["actv", "grad_reduced"]}},
        {"param_distribution": True, "prometheus": {"families": ["param_origin", "comm"]}},
        {"update_distribution": True, "prometheus": {"families": ["update"]}},
        # an escalation after an anomaly writes every module's activations, with xy_distribution off
        {
            "wg_distribution": True,
            "prometheus": {"families": ["actv"]},
            "alert": {"rules": [_rule("AnomalyNan")], "escalate_steps": 2},
        },
    ],
)
def test_prometheus_families_that_may_have_rows_say_nothing(tmp_path, out_dir, static_mode, caplog, keys):
    assert not _attach_warnings(tmp_path, caplog, format=["csv", "prometheus"], **keys)


def _train_warnings(tmp_path, caplog, steps: int, start: int = 0, **cfg_keys) -> tuple[list[str], object]:
    """The trainermon warnings of `steps` steps of a tiny model (set_monitor to close), and the monitor."""
    from trainermon import TrainerMon

    model = nn.Sequential(nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        monitor = TrainerMon(write_config(tmp_path / "cfg.json", **cfg_keys))
        monitor.set_monitor(model, optimizer=opt, start_iteration=start)
        for _ in range(steps):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        monitor.close()
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING], monitor


@pytest.mark.parametrize(
    "start, start_step, collected", [(0, 3, []), (0, 7, []), (0, 2, [2]), (100, 500, [])]
)
def test_a_start_step_the_run_never_reached_is_said_at_close(
    tmp_path, out_dir, static_mode, caplog, start, start_step, collected
):
    """A production config (start_step 3 or 7) on a 3-step trial run (steps 0-2) collected nothing, and
    nothing said so. A run resumed at step 100 counts its own 3 steps."""
    lines, monitor = _train_warnings(tmp_path, caplog, 3, start, wg_distribution=True, start_step=start_step)
    assert sorted({int(r["step"]) for r in read_family(monitor.run_dir, "grad_reduced")}) == collected
    said = f"the run ended after 3 step(s) (at step {start + 3}), before start_step {start_step}"
    expected = [] if collected else [f"trainermon: no step was collected: {said}"]
    assert lines == expected


def test_cc_distribution_without_torch_distributed_is_said_once(tmp_path, out_dir, static_mode, caplog):
    """cc_distribution on in a process without torch.distributed watched nothing and wrote no comm row,
    with no word."""
    lines, _ = _train_warnings(tmp_path, caplog, 3, cc_distribution={"enable": True})
    assert len(lines) == 1, lines
    assert "cc_distribution is on but torch.distributed is not initialized" in lines[0], lines


def test_target_of_frozen_parameters_says_they_are_frozen(tmp_path, out_dir, static_mode, caplog):
    """A target whose parameters are all frozen is not a typo: the warning says they are frozen (it said
    "no parameter name starts with it", and offered the closest names)."""
    from trainermon import TrainerMon

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    model[0].requires_grad_(False)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        monitor = TrainerMon(
            write_config(tmp_path / "cfg.json", targets={"0.": {}, "2.": {}}, wg_distribution=True)
        )
        monitor.set_monitor(model, optimizer=torch.optim.SGD(model[2].parameters(), lr=0.1))
        model(torch.randn(3, 4)).sum().backward()
        monitor.loop.adapter.optimizer.step()
        monitor.close()
    lines = _warnings(caplog)
    assert len(lines) == 1, lines
    assert "'0.' selects only frozen parameters" in lines[0] and "'0.weight', '0.bias'" in lines[0], lines
    assert {n for (n, _, _) in keyed(read_family(monitor.run_dir, "grad_reduced"))} == {"2.weight", "2.bias"}


def test_a_target_may_start_at_the_layers_segment(tmp_path, out_dir, static_mode, caplog):
    """HF models name blocks `model.layers.N`: target "layers.0" selects `model.layers.0.*` whatever
    `squash_name` says (it did before the msprobe squash rules; msprobe 26.2 matches it only with
    squash_name on, so this selects more there, never less). Names are written in full without squash."""
    from trainermon import TrainerMon

    class Hf(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Module()
            self.model.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

        def forward(self, x):
            return self.model.layers[1](self.model.layers[0](x))

    for squash in (False, True):
        cfg = write_config(
            tmp_path / f"c{squash}.json",
            targets={"layers.0": {}},
            wg_distribution=True,
            squash_name=squash,
            ndigits=12,
        )
        torch.manual_seed(0)
        model = Hf()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        monitor = TrainerMon(cfg)
        with caplog.at_level(logging.WARNING, logger="trainermon"):
            monitor.set_monitor(model, optimizer=opt)
        model(torch.randn(2, 4)).sum().backward()
        want = float(model.model.layers[0].weight.grad.double().norm())
        opt.step()
        opt.zero_grad()
        monitor.close()
        rows = {r["name"]: r for r in read_family(monitor.run_dir, "grad_reduced")}
        prefix = "" if squash else "model."
        assert set(rows) == {f"{prefix}layers.0.weight", f"{prefix}layers.0.bias"}, squash
        assert float(rows[f"{prefix}layers.0.weight"]["norm"]) == pytest.approx(want, rel=1e-6)
    assert not _warnings(caplog)


@pytest.mark.parametrize("targets", [{"block.1": {}}, {"block.1": {}, "block.0": {}}])
def test_target_of_a_parameter_free_module_with_activations_off_warns(
    tmp_path, out_dir, static_mode, caplog, targets
):
    """`block.1` is an nn.GELU: with only weight families on it selects no tensor any family writes. It
    was counted as selecting something when another target selected parameters, with no word."""
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        monitor, refs = _train(tmp_path, targets=targets, wg_distribution=True, xy_distribution=False)
    lines = _warnings(caplog)
    assert len(lines) == 1, lines  # the target alone: no second "family with nothing" line for it
    assert "activations are off (xy_distribution is false)" in lines[0], lines
    assert "target 'block.1' selects nothing: it names only modules without parameters" in lines[0], lines
    rows = {n for (n, _, _) in keyed(read_family(monitor.run_dir, "grad_reduced"))}
    assert rows == ({"block.0.weight", "block.0.bias"} if "block.0" in targets else set()), rows


def test_all_xy_is_no_family_in_the_switch_notes(tmp_path):
    """all_xy only widens xy_distribution (alone it selects nothing, as in msprobe): the notes of
    `idle_switches` (and `trainermon check-config`) neither count it as a family nor suggest it."""
    from trainermon.config import load_config
    from trainermon.runtime.targets import idle_switches

    def notes(**keys) -> list[str]:
        return idle_switches(load_config(write_config(tmp_path / "c.json", **keys)), 1, True)

    alone = notes(all_xy=True, module_ranks=[3])
    assert len(alone) == 1 and "switches on no family, so nothing is collected" in alone[0], alone
    assert "'xy_distribution'" in alone[0] and "'all_xy'" not in alone[0], alone
    assert "'all_xy'" not in notes()[0]
    assert notes(all_xy=True, wg_distribution=True, forward_only=True) == [
        "forward_only has no effect: activations are off (xy_distribution is false)"
    ]
    assert notes(all_xy=True, xy_distribution=True, forward_only=True) == []


class _ActAndProj(nn.Module):
    """`act` (no parameters) beside `act_proj`: the prefix `act` selects only the sibling's weights."""

    def __init__(self) -> None:
        super().__init__()
        self.act, self.act_proj = nn.GELU(), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act_proj(self.act(x))


def test_a_prefix_of_a_parameter_free_module_is_not_told_to_end_with_a_dot(
    tmp_path, out_dir, static_mode, caplog
):
    """The advice "end it with '.' ('act.') to select that module alone" pointed to a target that selects
    nothing (`act` has no parameter); it now says the prefix selects only the other module's."""
    from trainermon import TrainerMon

    cfg = write_config(tmp_path / "cfg.json", targets={"act": {}}, wg_distribution=True)
    model = _ActAndProj()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        monitor.set_monitor(model, optimizer=opt)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        monitor.close()
    lines = _warnings(caplog)
    assert len(lines) == 1 and "end it with" not in lines[0], lines
    assert "only other modules' ('act_proj.weight')" in lines[0], lines
    assert "module 'act' has no trainable one" in lines[0], lines
    assert {n for (n, _, _) in keyed(read_family(monitor.run_dir, "grad_reduced"))} == {
        "act_proj.weight",
        "act_proj.bias",
    }


def test_a_prefix_no_module_has_is_not_called_a_module(tmp_path, out_dir, static_mode, caplog):
    """`fc` beside `fc1`/`fc2` (no module `fc`): the advice to end it with '.' pointed to a module that
    does not exist, as did "module 'fc' has no trainable one"; it says no module has that name."""
    from trainermon import TrainerMon

    cfg = write_config(tmp_path / "cfg.json", targets={"fc": {}}, wg_distribution=True)
    model = nn.Sequential()
    model.fc1, model.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        monitor.set_monitor(model, optimizer=opt)
        monitor.close()
    lines = [line for line in _warnings(caplog) if "name prefix" in line]
    assert len(lines) == 1 and "no module is named 'fc'" in lines[0], _warnings(caplog)
    assert "end it with" not in lines[0] and "has no trainable" not in lines[0], lines
