"""Reliability under faults (issue 11), security: the Prometheus endpoint listens on loopback (or the
configured host) only, no code evaluates or unpickles config or data, output paths cannot leave
MONITOR_OUTPUT_DIR, and the config file is the only control channel.

docs/RELIABILITY.md lists every test, its measured result, and the defects these tests found.
"""

from __future__ import annotations

import ast
import builtins
import glob
import http.client
import json
import logging
import socket
import textwrap
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.helpers import write_config
from tests.reliability.faults import REPO, _exporter, _listening, _small_model, _steps
from trainermon import ConfigError, TrainerMon, parse_config


def _listeners(port: int | None = None) -> list[tuple[str, int]]:
    found = _listening()
    return found if port is None else [a for a in found if a[1] == port]


def test_prometheus_binds_loopback_by_default_and_only_the_configured_host(tmp_path, out_dir, static_mode):
    for host, other in ((None, "127.0.0.2"), ("127.0.0.2", "127.0.0.1")):
        section = {} if host is None else {"host": host}
        cfg = write_config(
            tmp_path / "cfg.json", wg_distribution=True, format=["prometheus"], prometheus=section
        )
        model, opt = _small_model()
        mon = TrainerMon(cfg)
        mon.set_monitor(model, optimizer=opt)
        try:
            exporter = _exporter(mon, "PrometheusExporter")
            bound = host or "127.0.0.1"
            assert exporter.server.socket.getsockname() == (bound, exporter.port)
            assert _listeners(exporter.port) == [(bound, exporter.port)]  # no 0.0.0.0 or :: listener
            urllib.request.urlopen(f"http://{bound}:{exporter.port}/metrics", timeout=5).read()
            with pytest.raises(OSError):  # the same port on another loopback address: nobody listens
                socket.create_connection((other, exporter.port), timeout=2).close()
        finally:
            mon.close()


#: Calls that deserialize or evaluate data: (module, attribute) after alias resolution, "*" = any.
UNSAFE_CALLS = {
    ("builtins", "eval"): "evaluates a string",
    ("builtins", "exec"): "executes a string",
    ("builtins", "compile"): "compiles a string",
    ("builtins", "__import__"): "imports a name from data",
    ("importlib", "import_module"): "imports a name from data",
    ("pickle", "*"): "unpickling runs arbitrary code",
    ("_pickle", "*"): "unpickling runs arbitrary code",
    ("cPickle", "*"): "unpickling runs arbitrary code",
    ("dill", "*"): "unpickling runs arbitrary code",
    ("cloudpickle", "*"): "unpickling runs arbitrary code",
    ("marshal", "*"): "unmarshalling code objects",
    ("shelve", "*"): "shelve is pickle",
    ("yaml", "load"): "yaml.load can build arbitrary objects (use safe_load)",
    ("yaml", "unsafe_load"): "builds arbitrary objects",
    ("yaml", "full_load"): "builds arbitrary objects",
    ("pandas", "read_pickle"): "unpickling",
    ("os", "system"): "a shell",
    ("os", "popen"): "a shell",
    ("torch.distributed", "broadcast_object_list"): "pickles over the wire",
    ("torch.distributed", "all_gather_object"): "pickles over the wire",
    ("torch.distributed", "gather_object"): "pickles over the wire",
    ("torch.distributed", "scatter_object_list"): "pickles over the wire",
    ("torch.distributed", "recv_object_list"): "pickles over the wire",
    ("torch.distributed", "send_object_list"): "pickles over the wire",
}
#: Reviewed exceptions: (file relative to the repository, call) -> why it is safe.
ALLOWED_UNSAFE = {
    ("adapters/__init__.py", "importlib.import_module"): "adapter modules from the constant ADAPTERS table",
    ("trainermon/analysis/engines.py", "importlib.import_module"): "constant names: duckdb, pyspark",
}


def unsafe_calls(source: str, filename: str) -> list[str]:
    """Calls in `source` that evaluate or deserialize data (see UNSAFE_CALLS), with alias resolution;
    torch.load without weights_only=True, numpy.load with allow_pickle=True and any subprocess call with
    shell=True count too."""
    tree = ast.parse(source, filename)
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"

    def dotted(expr: ast.expr) -> str | None:
        if isinstance(expr, ast.Name):
            if expr.id in aliases:
                return aliases[expr.id]
            return f"builtins.{expr.id}" if hasattr(builtins, expr.id) else expr.id
        if isinstance(expr, ast.Attribute):
            base = dotted(expr.value)
            return None if base is None else f"{base}.{expr.attr}"
        return None

    def kw(call: ast.Call, name: str):
        for k in call.keywords:
            if k.arg == name and isinstance(k.value, ast.Constant):
                return k.value.value
        return None

    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = dotted(node.func)
        if name is None:
            continue
        name = name.replace("torch.distributed.distributed_c10d", "torch.distributed")
        module, _, attr = name.rpartition(".")
        why = UNSAFE_CALLS.get((module, attr)) or UNSAFE_CALLS.get((module, "*"))
        if why is None and module.split(".")[0] in ("pickle", "_pickle", "cPickle", "dill", "cloudpickle"):
            why = "unpickling runs arbitrary code"
        if name == "torch.load" and kw(node, "weights_only") is not True:
            why = "torch.load without weights_only=True unpickles"
        if name in ("numpy.load", "np.load") and kw(node, "allow_pickle") is True:
            why = "numpy.load with allow_pickle=True unpickles"
        if module == "subprocess" and kw(node, "shell") is True:
            why = "a shell"
        if why:
            found.append(f"{filename}:{node.lineno}: {name} ({why})")
    return found


def test_unsafe_call_scanner_finds_what_it_should():
    bad = textwrap.dedent(
        """
        import pickle, yaml, marshal, numpy as np, torch, subprocess
        import torch.distributed as dist
        from pickle import loads as l
        from torch.distributed import all_gather_object
        pickle.loads(b""); l(b""); yaml.load(s); marshal.loads(b""); eval("1"); exec("x")
        torch.load(p); torch.load(p, weights_only=False); np.load(p, allow_pickle=True)
        dist.broadcast_object_list([x]); all_gather_object([], x); subprocess.run(c, shell=True)
        """
    )
    safe = textwrap.dedent(
        """
        import json, re, yaml, numpy as np, torch, subprocess
        json.loads(s); re.compile(p); yaml.safe_load(s); np.load(p); torch.load(p, weights_only=True)
        subprocess.run(["ls"]); getattr(o, "x")
        """
    )
    assert [hit.split(" ")[1] for hit in unsafe_calls(bad, "bad.py")] == [
        "pickle.loads", "pickle.loads", "yaml.load", "marshal.loads", "builtins.eval", "builtins.exec",
        "torch.load", "torch.load", "numpy.load",
        "torch.distributed.broadcast_object_list", "torch.distributed.all_gather_object", "subprocess.run",
    ]  # fmt: skip
    assert unsafe_calls(safe, "safe.py") == []


def test_package_never_evaluates_or_unpickles_config_or_data():
    found = []
    files = 0
    for top in ("trainermon", "adapters", "exporters"):
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            files += 1
            for hit in unsafe_calls(path.read_text(encoding="utf-8"), rel):
                call = hit.split(": ", 1)[1].split(" ", 1)[0]
                if (rel, call) not in ALLOWED_UNSAFE:
                    found.append(hit)
    assert files > 30
    assert found == []


@pytest.mark.parametrize("key", ["parquet.dir", "prometheus.sd_dir"])
@pytest.mark.parametrize(
    "value", ["/etc/cron.d", "..", "../outside", "a/../../outside", "a/..", "..\\\\outside", "x\x00y"]
)
def test_output_paths_cannot_escape_the_output_dir(key, value):
    section, sub = key.split(".")
    with pytest.raises(ConfigError) as exc:
        parse_config({section: {sub: value}})
    message = str(exc.value)
    assert f"'{key}'" in message and repr(value)[:20] in message
    assert "relative to MONITOR_OUTPUT_DIR without '..'" in message


def test_output_goes_only_under_monitor_output_dir(tmp_path, dynamic_mode, monkeypatch, caplog):
    """Every sink, stack_info, anomaly dumps, discovery files, a dynamic reload: files appear only under
    MONITOR_OUTPUT_DIR (the config file itself aside), wherever it points; an escaping edit is refused."""
    assert parse_config({"parquet": {"dir": "./data/ds"}, "prometheus": {"sd_dir": "sd"}}).parquet.dir
    monkeypatch.chdir(tmp_path / "cwd" if (tmp_path / "cwd").mkdir() is None else tmp_path)
    cfg = write_config(
        tmp_path / "cfg.json",
        dynamic_on=True,
        xy_distribution=True,
        all_xy=True,
        wg_distribution=True,
        mv_distribution=True,
        param_distribution=True,
        stack_info=True,
        ops=["norm", "nans"],
        format=["csv", "parquet", "prometheus"],
        parquet={"dir": "data/ds", "steps_per_part": 1},
        prometheus={"sd_dir": "sd"},
        alert={"rules": [{"rule_name": "AnomalyNan", "args": {}}], "dump": True},
    )
    for out in (tmp_path / "out", tmp_path / "elsewhere" / "deep"):
        monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
        model, opt = _small_model()
        mon = TrainerMon(cfg)
        mon.set_monitor(model, optimizer=opt)
        _steps(model, opt, 2)
        with torch.no_grad():
            model[0].weight[0, 0] = float("nan")  # an anomaly: the detector dumps it
        _steps(model, opt, 1)
        good = json.loads(Path(cfg).read_text())
        with caplog.at_level(logging.WARNING, logger="trainermon"):
            Path(cfg).write_text(json.dumps({**good, "parquet": {"dir": "../escaped"}}))
            mon.loop.control.watcher.dirty = True
            _steps(model, opt, 1)
        assert mon.config.parquet.dir == "data/ds"  # the escaping edit was refused ...
        assert "parquet.dir" in caplog.text and "relative to MONITOR_OUTPUT_DIR" in caplog.text  # ... loudly
        Path(cfg).write_text(json.dumps(good))
        mon.close()
        assert glob.glob(str(out / "data" / "ds" / "family=*" / "rank=0" / "part-*.parquet"))
        assert glob.glob(str(out / "anomaly_detected" / "*.jsonl"))
        assert glob.glob(str(out / "*-rank0-*" / "stack_info.csv"))
    written = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    outside = {p for p in written if not p.startswith(("out/", "elsewhere/deep/"))}
    assert outside == {"cfg.json"}, sorted(outside)
    assert any(p.startswith("elsewhere/deep/data/ds/") for p in written)


def test_control_file_is_the_only_control_channel(tmp_path, dynamic_mode, out_dir):
    """A dynamic monitor listens on nothing; with the Prometheus sink, on exactly its one (read-only) port."""
    for formats, expected in ((["csv"], 0), (["csv", "prometheus"], 1)):
        cfg = write_config(tmp_path / "cfg.json", dynamic_on=True, wg_distribution=True, format=formats)
        before = set(_listening())
        model, opt = _small_model()
        mon = TrainerMon(cfg)
        mon.set_monitor(model, optimizer=opt)
        _steps(model, opt, 2)
        new = set(_listening()) - before
        try:
            assert mon.loop.control is not None and mon.loop.control.watcher is not None
            assert len(new) == expected, new
            if expected:
                exporter = _exporter(mon, "PrometheusExporter")
                assert new == {("127.0.0.1", exporter.port)}
                # The endpoint only serves the metrics page: no method changes anything.
                for method in ("POST", "PUT", "DELETE"):
                    conn = http.client.HTTPConnection("127.0.0.1", exporter.port, timeout=5)
                    conn.request(method, "/metrics", body=b'{"dynamic_on": false}')
                    assert conn.getresponse().status == 501
                    conn.close()
                assert mon.config.dynamic_on and mon.loop.plan.collecting
        finally:
            mon.close()
        assert set(_listening()) - before == set()  # closed: nothing left listening
