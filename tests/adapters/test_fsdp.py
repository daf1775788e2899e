"""FSDP1 and FSDP2 on 2 gloo ranks (one launch): every family against references computed in the test."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.adapters.fsdp_cases import ACTV_MODULES, CASES, MAX_NORM, OPS, STEPS, _matrix
from tests.distributed import run_ranks
from tests.helpers import assert_row_matches, keyed, read_family

# The whole matrix runs in one 2-rank launch (the module-scoped fixture); each configuration trains a small
# model for a few steps beside a plain, unsharded replica trained in lockstep on the same batches:
# - grad_unreduced: the replica's local gradient on this rank's batch (in the FSDP compute dtype);
# - grad_reduced: the replica's gradients averaged over the ranks (all_reduce), the optimizer's input;
# - param_origin / exp_avg / exp_avg_sq / param_updated: the replica's Adam, fed those averaged gradients;
# - actv: the replica's module outputs;
# - the global grad norm: FSDP's own `clip_grad_norm_` total norm on the same step (FSDP1's method, torch's
#   function on FSDP2's DTensor gradients), with a max_norm that clips every step: the rows and the norm are
#   read before the clipping scales the gradients (the replica is clipped the same way before its update).
# At the end the replica's parameters are also checked against FSDP's gathered ones (summon_full_params /
# full_tensor(): test references only).

SHARDED_FAMILIES = ("grad_reduced", "param_origin", "exp_avg", "exp_avg_sq", "param_updated", "update")


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    return run_ranks(_matrix, world_size=2, out_root=str(tmp_path_factory.mktemp("fsdp")))


def _check(rows: dict, refs: dict, family: str, names: list[str], micros: list, rtol: float) -> None:
    assert {name for (name, _s, _m) in rows} == set(names), f"{family}: {sorted(rows)} != {sorted(names)}"
    assert len(rows) == STEPS * len(names) * len(micros), f"{family}: unexpected rows {sorted(rows)}"
    for step in range(STEPS):
        for name in names:
            for micro in micros:
                ref = refs[(family, name, step, micro)]
                assert_row_matches(rows[(name, step, micro)], ref, OPS, rtol=rtol)


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_fsdp_families_match_references(
    matrix: list[dict[str, dict[str, Any]]], case: dict[str, Any]
) -> None:
    r0, r1 = matrix[0][case["id"]], matrix[1][case["id"]]
    names = r0["names"]
    acc, mbs, bf16 = case.get("acc", 1), case.get("mbs", False), case.get("mp", False)
    assert r0["adapter"] == f"fsdp{case['fsdp']}"
    assert r0["faults"] == 0 and r1["faults"] == 0
    # msprobe names FSDP's gradients before the reduce-scatter `pre_grad` (plain torch: `acc_grad`)
    assert r0["unreduced_tags"] == ["rank0/pre_grad"] and r1["unreduced_tags"] == ["rank1/pre_grad"]
    assert max(r0["drift"].values()) < 1e-5, r0["drift"]
    assert r0["empty_here"] + r1["empty_here"] > 0, "no parameter without elements on a rank: edge untested"
    assert all("_fsdp_wrapped_module" not in n and "_checkpoint" not in n for n in names)

    # Optimizer-side families: full-parameter statistics, written once by rank 0 of the shard group.
    for family in SHARDED_FAMILIES:
        _check(keyed(read_family(r0["run_dir"], family)), r0["refs"], family, names, [None], rtol=1e-5)
        assert read_family(r1["run_dir"], family) == [], f"rank 1 wrote {family}"
    # update: ||dw|| / ||w_before|| formed after the shards' sums of squares were merged
    for row in read_family(r0["run_dir"], "update"):
        want = r0["refs"][("update", row["name"], int(row["step"]), None)]["ratio"]
        assert float(row["ratio"]) == pytest.approx(want, rel=1e-5), row

    # Pre-reduce gradients: every rank's own full-shape local gradient (the step's sum over its
    # micro-batches, or each micro-batch's own with monitor_mbs_grad), in the dtype FSDP reduces.
    unreduced_dtype = "torch.float32" if not bf16 or (acc > 1 and not mbs) else "torch.bfloat16"
    for result in (r0, r1):
        rows = keyed(read_family(result["run_dir"], "grad_unreduced"))
        micros = list(range(acc)) if mbs else [None]
        _check(rows, result["refs"], "grad_unreduced", names, micros, rtol=1e-2 if bf16 else 1e-5)
        assert {r["dtype"] for r in rows.values()} == {unreduced_dtype}
    shapes = {r["name"]: json.loads(r["shape"]) for r in read_family(r0["run_dir"], "grad_unreduced")}
    assert shapes["scale"] == [1] and shapes["inp.weight"] == [16, 8]

    # Global grad norm = sqrt(sum of grad_reduced norm^2) = FSDP's clip_grad_norm_ total norm, pre-clip.
    reduced = read_family(r0["run_dir"], "grad_reduced")
    for step in range(STEPS):
        assert r0["clip_norms"][step] > 10 * MAX_NORM  # the clipping did scale the gradients
        total = math.sqrt(sum(float(r["norm"]) ** 2 for r in reduced if int(r["step"]) == step))
        assert total == pytest.approx(r0["clip_norms"][step], rel=1e-5)
    assert r0["global_norm"] == pytest.approx(r0["clip_norms"][-1], rel=1e-5)

    # Activations of the user's modules (wrappers are not layers), recomputation not counted twice.
    for result in (r0, r1):
        actv = keyed(read_family(result["run_dir"], "actv"))
        layer_names = {n.rsplit(".", 1)[0] for (n, _s, _m) in actv}
        assert "" not in layer_names and not any(
            "_fsdp_wrapped" in n or "_checkpoint" in n for n in layer_names
        )
        assert {"inp", "blocks.0", "blocks.0.fc1", "blocks.1.fc2", "norm", "head"} <= layer_names
        for step in range(STEPS):
            assert {(n, s, m) for (n, s, m) in actv if s == step and n.endswith(".output")} == {
                (f"{layer}.output", step, micro) for layer in layer_names for micro in range(acc)
            }
            for module in ACTV_MODULES:
                for micro in range(acc):
                    key = (f"{module}.output", step, micro)
                    ref = result["refs"][("actv", key[0], step, micro)]
                    assert_row_matches(actv[key], ref, OPS, rtol=1e-2 if bf16 else 1e-5)


def test_example_script_runs(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(root / "examples" / "fsdp_train.py"), "--steps", "2", "--out", str(out)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for fsdp in ("fsdp1", "fsdp2"):
        run_dirs = sorted((out / fsdp).glob("*-rank0-*"))
        assert len(run_dirs) == 1, list((out / fsdp).iterdir())
        rows = read_family(str(run_dirs[0]), "grad_reduced")
        assert {int(r["step"]) for r in rows} == {0, 1}
        assert any(r["name"] == "layers.0.attn_proj.weight" for r in rows), {r["name"] for r in rows}
        assert all(float(r["norm"]) > 0 for r in rows)
        assert read_family(str(sorted((out / fsdp).glob("*-rank1-*"))[0]), "grad_unreduced")
