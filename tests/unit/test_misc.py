"""print_struct, stack_info, names, the optional torch_npu import, activation checkpointing."""

from __future__ import annotations

import json
import os
import sys
import types

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.helpers import read_family, write_config
from trainermon import PrintStructDone, TrainerMon
from trainermon import _device as device_mod
from trainermon.names import clean_name, squash_name, unique_names


def test_print_struct_writes_structure_then_stops(tmp_path, out_dir):
    cfg = write_config(tmp_path / "cfg.json", print_struct=True)
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    model(torch.ones(2, 3)).sum().backward()
    with pytest.raises(PrintStructDone, match="module_struct.json"):
        opt.step()
    path = tmp_path / "out" / "module_struct" / "rank0" / "module_struct.json"
    struct = json.loads(path.read_text())
    # msprobe's layout (tests/unit/test_struct_stack_msprobe.py compares it with msprobe's own file)
    assert struct["0:0"] == {
        "input": {"config": "list[1]", "0": "size=(2, 3), dtype=torch.float32"},
        "output": {"config": "tensor", "tensor": "size=(2, 5), dtype=torch.float32"},
        "input_grad": {"config": "tuple[1]", "0": "<class 'NoneType'>"},
        "output_grad": {"config": "tuple[1]", "0": "size=(2, 5), dtype=torch.float32"},
        "class": "Linear",
    }
    assert list(struct) == ["0:0", "0:1", "0:"]


def test_stack_info_written_once_per_module(tmp_path, out_dir):
    cfg = write_config(tmp_path / "cfg.json", xy_distribution=True, stack_info=True)
    model = nn.Sequential(nn.Linear(3, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    for _ in range(3):
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
    monitor.close()
    import csv

    with open(os.path.join(monitor.run_dir, "stack_info.csv"), newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["module_name"] for r in rows] == ["0:0", "0:"]  # every module, the root too, as msprobe
    assert "test_stack_info_written_once_per_module" in rows[0]["stack_info"]


def test_names():
    assert (
        clean_name("layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.fc.weight")
        == "layers.0.fc.weight"
    )
    assert clean_name("_orig_mod.encoder.weight") == "encoder.weight"
    assert squash_name("language_model.encoder.layers.3.mlp.weight") == "layers.3.mlp.weight"
    assert unique_names(["a", "a", "b"], ["x.a", "y.a", "b"]) == ["a", "y.a", "b"]  # msprobe: first keeps it
    assert unique_names(["a", "a"], ["a", "a"]) == ["a", "a#1"]
    # model chunks: rows carry their vpp stage, so the same short name in two chunks is no collision
    assert unique_names(["a", "a", "a"], ["x.a", "y.a", "z.a"], [0, 1, 1]) == ["a", "a", "z.a"]


def test_slot_names_per_count_as_msprobe_numbers_them():
    from trainermon.runtime.probes.slots import Names

    names = Names("m.input")
    want = {1: ["m.input"], 2: ["m.input_0", "m.input_1"], 3: ["m.input_0", "m.input_1", "m.input_2"]}
    for count in (2, 2, 1, 3, 2, 1, 0):  # the first count is kept in slots, the others in a dict
        assert names(count) == want.get(count, [])
    assert names(2) is names(2) and names(1) is names(1)  # kept, not rebuilt per call


def test_wrapper_prefixes_removed_for_compiled_models(tmp_path, out_dir):
    cfg = write_config(tmp_path / "cfg.json", wg_distribution=True)
    inner = nn.Sequential(nn.Linear(2, 2))
    wrapped = torch.compile(inner, backend="eager")
    opt = torch.optim.SGD(inner.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(wrapped, optimizer=opt)
    wrapped(torch.ones(1, 2)).sum().backward()
    opt.step()
    monitor.close()
    assert {r["name"] for r in read_family(monitor.run_dir, "grad_reduced")} == {"0.weight", "0.bias"}


def test_torch_npu_guarded_import(monkeypatch):
    """No Ascend device here: a fake torch_npu module stands in for the real one (and a broken one)."""
    fake = types.ModuleType("torch_npu")
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    device_mod._reset_for_tests()
    assert device_mod.torch_npu() is fake

    class Broken(types.ModuleType):
        def __getattr__(self, name):
            raise AttributeError(name)

    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import raises ImportError
    device_mod._reset_for_tests()
    assert device_mod.torch_npu() is None

    def failing_import(name, *args, **kwargs):
        if name == "torch_npu":
            raise RuntimeError("libascend.so: cannot open shared object file")
        return original_import(name, *args, **kwargs)

    import builtins

    original_import = builtins.__import__
    monkeypatch.delitem(sys.modules, "torch_npu")
    monkeypatch.setattr(builtins, "__import__", failing_import)
    device_mod._reset_for_tests()
    assert device_mod.torch_npu() is None  # a RuntimeError is caught too, not only ImportError
    device_mod._reset_for_tests()


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(checkpoint(self.inner, x, use_reentrant=False))


def test_recomputed_forward_is_not_counted_twice(tmp_path, out_dir):
    cfg = write_config(tmp_path / "cfg.json", xy_distribution=True, ops=["norm"])
    torch.manual_seed(0)
    model = Checkpointed()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    model(torch.randn(3, 4, requires_grad=True)).sum().backward()
    opt.step()
    monitor.close()
    names = [r["name"] for r in read_family(monitor.run_dir, "actv")]
    assert names.count("inner.0.output") == 1  # the recomputation during backward is skipped
    grads = {r["name"] for r in read_family(monitor.run_dir, "actv_grad")}
    assert {"inner.0.output", "head.output", "inner.0.input"} <= grads


def test_csv_fields_quoted_as_the_csv_module_quotes_them():
    """A field is the csv module's text for it (default dialect), so that any CSV reader reads it back;
    text that needs no quotes is returned itself, not copied."""
    import csv
    import io

    from trainermon.exporters.csv import _csv_field

    texts = ["layers.0.mlp", "", "a,b", 'say "hi"', "two\nlines", "cr\rhere", " padded ", "ünï,cödé", '"']
    for text in texts:
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\r\n").writerow([text])
        assert _csv_field(text) == buf.getvalue()[:-2], text
        line = f"0,{_csv_field(text)},1"
        assert next(csv.reader(io.StringIO(line))) == ["0", text, "1"]
    name = "layers.0.mlp"
    assert _csv_field(name) is name


def test_csv_reuses_text_only_for_identical_lines(tmp_path):
    """grad_reduced equal to grad_unreduced (one replica) is formatted once and written to both files;
    one differing value, name or count makes the families format separately."""
    import numpy as np

    from trainermon.collect.records import RowMeta, StatBatch
    from trainermon.config import parse_config
    from trainermon.exporters.base import RunInfo
    from trainermon.exporters.csv import CsvExporter

    cfg = parse_config({"ops": ["norm", "min", "nans"]})
    exporter = CsvExporter()
    exporter.open(RunInfo(str(tmp_path), str(tmp_path), 0, 1, "r", cfg))

    def rows(family, names):
        return [RowMeta(family, 0, n, None, (2, 3), torch.float32, 6) for n in names]

    def batch(step, names_b, norms_b, nans_b):
        meta = rows("grad_unreduced", ["w", "b"]) + rows("grad_reduced", names_b)
        values = {
            "norm": np.array([1.5, float("nan"), *norms_b]),
            "min": np.array([-1.0, 0.0, -1.0, 0.0]),
            "nans": np.array([0.0, 2.0, *nans_b]),
        }
        return StatBatch(step=step, rows=meta, values=values)

    exporter.write(batch(0, ["w", "b"], [1.5, float("nan")], [0.0, 2.0]))  # identical: reused
    exporter.write(batch(1, ["w", "b"], [1.5, 2.5], [0.0, 2.0]))  # a norm differs
    exporter.write(batch(2, ["w", "x"], [1.5, float("nan")], [0.0, 2.0]))  # a name differs
    exporter.write(batch(3, ["w", "b"], [1.5, float("nan")], [0.0, 1.0]))  # a count differs
    exporter.close()
    unreduced = read_family(str(tmp_path), "grad_unreduced")
    reduced = read_family(str(tmp_path), "grad_reduced")
    assert [(r["name"], r["norm"], r["nans"]) for r in unreduced] == [
        ("w", "1.5", "0"),
        ("b", "nan", "2"),
    ] * 4
    assert [(r["step"], r["name"], r["norm"], r["nans"]) for r in reduced] == [
        ("0", "w", "1.5", "0"),
        ("0", "b", "nan", "2"),
        ("1", "w", "1.5", "0"),
        ("1", "b", "2.5", "2"),
        ("2", "w", "1.5", "0"),
        ("2", "x", "nan", "2"),
        ("3", "w", "1.5", "0"),
        ("3", "b", "nan", "1"),
    ]


def test_csv_row_texts_follow_new_rows_and_stay_bounded(tmp_path, monkeypatch):
    """The exporter keeps each row object's fixed fields as text. Rows whose shape changes every step
    (an MoE expert's token count) are new objects each step: their lines must carry their own shape and
    micro-step, and only the last step's rows keep texts. Name and shape texts are shared by rows and
    bounded by a step's rows; a new name each step (and a comma in it) comes out as written. A row object
    seen again keeps its texts (not rebuilt)."""
    import numpy as np

    import trainermon.exporters.csv as csv_exporter
    from trainermon.collect.records import RowMeta, StatBatch
    from trainermon.config import parse_config
    from trainermon.exporters.base import RunInfo

    exporter = csv_exporter.CsvExporter()
    exporter.open(RunInfo(str(tmp_path), str(tmp_path), 0, 1, "r", parse_config({"ops": ["norm", "shape"]})))
    sizes, names, shapes = [], [], []
    stable = RowMeta("param", 0, "w", None, (2, 2), torch.float32, 4)
    for step in range(12):
        rows = [
            RowMeta("actv", 0, f"e{i}", i % 2, (step + i, 4), torch.float32, 4 * (step + i)) for i in range(3)
        ]
        rows.append(RowMeta("actv", step % 2, f"new,{step}", 0, (1,), torch.float32, 1))
        rows.append(stable)
        exporter.write(StatBatch(step=step, rows=rows, values={"norm": np.arange(5.0) + step}))
        if step == 0:
            texts = exporter._by_row[id(stable)]
        assert exporter._by_row[id(stable)] is texts  # a row seen again: its texts kept
        sizes.append(len(exporter._by_row))
        names.append(sum(len(by_name) for by_name in exporter._names.values()))
        shapes.append(len(exporter._shapes))
    exporter.close()
    got = sorted(
        (
            (r["step"], r["vpp_stage"], r["name"], r["micro_step"], r["shape"], r["norm"])
            for r in read_family(str(tmp_path), "actv")
        ),
        key=lambda line: (int(line[0]), line[2]),
    )
    want = [
        [(str(s), "0", f"e{i}", str(i % 2), str([s + i, 4]), f"{s + i:g}") for i in range(3)]
        + [(str(s), str(s % 2), f"new,{s}", "0", "[1]", f"{s + 3:g}")]
        for s in range(12)
    ]
    assert got == [line for step in want for line in step]
    assert sizes == [5] * 12  # this step's rows only
    assert max(names) <= 5 + 5 and max(shapes) <= 5 + 5, (names, shapes)  # cleared past a step's rows
    assert read_family(str(tmp_path), "param")[-1]["name"] == "w"


def test_csv_families_of_one_tensor_share_their_texts(tmp_path):
    """The rows of one tensor in several families (a parameter's wg, mv and param rows) share one tuple of
    texts; a row that differs in any written field (micro-step, shard, shape) gets its own, and every
    family's lines carry that row's fields."""
    import numpy as np

    import trainermon.exporters.csv as csv_exporter
    from trainermon.collect.records import RowMeta, StatBatch
    from trainermon.config import parse_config
    from trainermon.exporters.base import RunInfo

    exporter = csv_exporter.CsvExporter()
    exporter.open(RunInfo(str(tmp_path), str(tmp_path), 0, 1, "r", parse_config({"ops": ["norm", "shape"]})))
    families = ("grad_reduced", "param_origin", "exp_avg")
    rows = [RowMeta(f, 0, "w", None, (2, 2), torch.float32, 4) for f in families]
    rows += [
        RowMeta("actv", 0, "w", 0, (2, 2), torch.float32, 4),
        RowMeta("actv_grad", 0, "w", 1, (2, 2), torch.float32, 4),  # another micro-step
        RowMeta("exp_avg_sq", 0, "w", None, (2, 2), torch.float32, 4, "Shard(0)"),  # a piece
        RowMeta("param_updated", 0, "w", None, (4,), torch.float32, 4),  # another shape
    ]
    exporter.write(StatBatch(step=0, rows=rows, values={"norm": np.arange(7.0)}))
    texts = [exporter._by_row[id(r)] for r in rows]
    assert texts[0] is texts[1] is texts[2]
    assert len({id(t) for t in texts}) == 5
    exporter.close()
    for i, family in enumerate(families):
        (line,) = read_family(str(tmp_path), family)
        assert (line["name"], line["shape"], line["norm"], line["shard"]) == ("w", "[2, 2]", f"{i:g}", "")
    assert [r["micro_step"] for r in read_family(str(tmp_path), "actv_grad")] == ["1"]
    assert [r["shard"] for r in read_family(str(tmp_path), "exp_avg_sq")] == ["Shard(0)"]
    assert [r["shape"] for r in read_family(str(tmp_path), "param_updated")] == ["[4]"]


def test_row_cache_keeps_the_rows_steps_use_and_drops_the_rest():
    """Rows whose shape changes every step (MoE experts' token counts) do not pile up in the collector's
    row cache: it stays within half again a step's rows (plus 1024), while a row used every step keeps its
    one object (the CSV writer's texts are kept by that object), which is also its own key (no second
    tuple per row)."""
    import torch

    from trainermon.collect.records import RowMetaCache

    cache = RowMetaCache()
    stable = [("actv", 0, f"layer{i}.output", 0, (4, 8), torch.float32, 32, "", 0, 0) for i in range(2000)]
    first = [cache.get(fields) for fields in stable]
    assert first[7] == stable[7] and first[7].name == "layer7.output"
    assert all(key is row for key, row in cache._rows.items())
    sizes = []
    for step in range(200):
        churn = [
            ("actv", 0, f"expert{i}.output", 0, (step, 8), torch.float32, 8 * step, "", 0, 0)
            for i in range(50)
        ]
        got = [cache.get(fields) for fields in stable + churn]
        assert all(a is b for a, b in zip(got, first))
        cache.end_step(len(stable) + len(churn))
        sizes.append(len(cache))
    assert max(sizes) <= 2050 + 1025 + 50  # a step's rows, the margin, one step's new rows
    assert min(sizes[100:]) >= 2000  # never emptied of the rows in use
